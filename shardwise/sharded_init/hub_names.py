"""Where zero.Init finds a parameter that the folder stores under other names (the hub's layouts).

transformers 5 keeps a model's parameters in one layout and the files it reads in another:
``save_pretrained`` writes Mixtral's experts one by one (``block_sparse_moe.experts.3.w1.weight``)
while the model holds one 3-D ``mlp.experts.gate_up_proj [E, 2I, H]``, and ``from_pretrained``
converts by the model type's *conversion mapping* (``transformers.conversion_mapping``): renamings,
then at most one converter that stacks each expert's tensors (``MergeModulelist(dim=0)``) and
concatenates the source patterns in their order (``Concatenate(dim=1)``: gate, then up).

zero.Init reads element ranges, never whole tensors, so the conversion is not replayed on tensors:
each model name is mapped, with transformers' own renaming functions, to *rows* of stored tensors.
Row ``e`` (expert ``e``) of the model's flattened tensor is the stored tensors of that expert, one
after another, each flattened; a rename is one row of one tensor. A range of the model's tensor is
then a few contiguous ranges of stored tensors, read as they are (bit for bit what
``from_pretrained`` builds). A converter with any other operation cannot be read by ranges and is
refused in one line, as is a conversion whose experts are incomplete.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

READABLE_OPS = (("MergeModulelist",), ("MergeModulelist", "Concatenate"))


@dataclass(frozen=True)
class StoredRows:
    """A model tensor as stored: ``rows[e]`` are the stored names whose flattened values, one after
    another, are row ``e`` of the model's tensor; ``problem`` says why it cannot be read, if so."""

    rows: tuple[tuple[str, ...], ...] = ()
    problem: str = ""
    stacked: bool = True  # False: a renamed tensor, read whole-shaped as it is stored


def hub_names(model: nn.Module, stored: list[str]) -> dict[str, StoredRows]:
    """Model parameter name -> its stored rows, for names the folder holds under other names.

    Uses the model's transformers conversion mapping; empty when it has none (not an HF model, or
    a model type stored under its own names)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key
    except ImportError:  # pragma: no cover - transformers is a dependency
        return {}
    if not isinstance(model, PreTrainedModel):
        return {}
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    # transformers' prefix rule asks `.get(name) is not None`: any non-None value marks a model name
    names = {n: True for n, _ in model.named_parameters(remove_duplicate=False)}
    prefix = getattr(model, "base_model_prefix", None) or None
    out: dict[str, StoredRows] = {}
    grouped: dict[str, tuple[Any, dict[str, list[tuple[int | None, str]]]]] = {}
    for key in sorted(stored, key=dot_natural_key):  # transformers' order: experts by number
        target, converter, pattern, index = _rename(key, renamings, converters, prefix, names)
        if target not in names or target in stored:
            continue
        if converter is None:
            out[target] = StoredRows(rows=((key,),), stacked=False)
        else:
            grouped.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append((index, key))
    for target, (converter, by_pattern) in grouped.items():
        out[target] = _stacked(converter, by_pattern)
    return out


def _rename(key: str, renamings: list, converters: list, prefix: str | None,
            names: dict) -> tuple[str, Any, str | None, int | None]:
    """transformers' renaming of one stored key (renamings, then the first converter that matches,
    then its base-model prefix rule): the model name, the converter and source pattern that matched
    and the expert number the pattern's ``*`` stands for (None where it cannot be told)."""
    from transformers.core_model_loading import apply_renamings, rename_source_key

    renamed = apply_renamings(key, renamings)
    found, pattern, index = None, None, None
    for conv in converters:
        new, pattern = conv.rename_source_key(renamed)
        if pattern is not None:
            star = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), renamed)
            index = int(star.group(1)) if star and star.groups() else None
            renamed, found = new, conv
            break
    renamed, _ = rename_source_key(renamed, [], [], base_model_prefix=prefix, meta_state_dict=names)
    return renamed, found, pattern, index


def _stacked(converter: Any, by_pattern: dict[str, list[tuple[int | None, str]]]) -> StoredRows:
    """One converter target: experts stacked, each expert its patterns' tensors in pattern order."""
    ops = tuple(type(op).__name__ for op in converter.operations)
    dims = [getattr(op, "dim", 0) for op in converter.operations]
    if ops not in READABLE_OPS or dims != [0, 1][:len(ops)]:
        return StoredRows(problem=f"it is built by transformers' {' + '.join(ops)} (dims {dims}), which zero.Init "
                                  "cannot read by element ranges")
    patterns = [p for p in converter.source_patterns if p in by_pattern]
    missing = [p for p in converter.source_patterns if p not in by_pattern]
    if missing:
        return StoredRows(problem=f"no stored tensor matches {missing[0]!r}")
    counts = {len(by_pattern[p]) for p in patterns}
    for p in patterns:
        numbers = [e if e is not None else i for i, (e, _) in enumerate(by_pattern[p])]
        lost = sorted(set(range(max(counts))) - set(numbers))
        if lost or numbers != sorted(numbers):
            return StoredRows(problem=f"expert {lost[0] if lost else '?'}'s tensor matching {p!r} is not stored "
                                      f"(experts stored: {numbers})")
    return StoredRows(rows=tuple(zip(*([k for _, k in by_pattern[p]] for p in patterns), strict=True)))


def folder_of(files: dict[str, Path]) -> str:
    """The folder a weight map reads from, for messages."""
    return os.fspath(next(iter(files.values())).parent) if files else "?"
