"""``shardwise.files``: the user's folders and files, read and written safely.

- ``safe``: the one path confinement (names resolved inside their folder, regular files only,
  guarded output folders, atomic writes).
- ``safetensors_io``: the one safetensors reader (``SafetensorsFile``) and the one dtype table.
- ``model_folder``: an HF model folder checked before transformers reads it; its errors as one line.

Why together: every byte shardwise reads from a user's folder passes ``safe`` first, and the
safetensors reader and the model-folder check are its two readers of foreign files; checkpoints,
inference, training data and the estimator all lean on them, so they stand low in the house and
import nothing above ``errors``.
"""
