"""A stock Hugging Face Trainer script with a DeepSpeed config, nothing shardwise in it: the way
transformers' docs write it. Under `shardwise launch --as-deepspeed` it runs on shardwise, on GPUs or
on a CPU-only machine (gloo), with no DeepSpeed installed and no change:

    shardwise launch --nproc 2 --as-deepspeed examples/hf_trainer/train_trainer.py \
        --deepspeed examples/hf_trainer/ds_zero2.json --max_steps 20 --output_dir runs/hf_trainer

The model is a tiny Llama built from a config and the data random tokens, so it needs no download;
swap in `from_pretrained` and your dataset.
"""

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, LlamaConfig, Trainer, TrainingArguments


def main():
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x.clone()} for x in ids]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    if trainer.is_world_process_zero():
        batch = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
        print(f"processes {args.world_size}, global batch {batch}, "
              f"final loss {trainer.state.log_history[-1]['train_loss']:.4f}")


if __name__ == "__main__":
    main()
