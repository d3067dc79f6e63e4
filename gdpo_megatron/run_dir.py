"""What a run directory holds: the names of its parts."""

CHECKPOINT_DIR = "checkpoints"  # training checkpoints, step_N/ and a `latest` pointer
HF_EXPORT_DIR = "hf"  # the policy as a Hugging Face directory, written at the end
