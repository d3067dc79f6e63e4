"""``python -m gdpo_megatron COMMAND [...]``: the console commands by name (``torchrun -m gdpo_megatron train ...``);
``python -m gdpo_megatron --help`` lists them."""
import importlib
import sys

from gdpo_megatron.commands.console import console_entry
from gdpo_megatron.commands.cpu_malloc import reexec_with_tcmalloc
from gdpo_megatron.errors import UsageError

# command -> (module under gdpo_megatron.commands, with main(argv); what it does)
COMMANDS = {
    "train": ("train", "train a policy with GDPO (gdpo-train)"),
    "eval": ("eval", "evaluate a Hugging Face checkpoint (gdpo-eval)"),
    "convert": ("convert", "convert between Hugging Face directories and Megatron checkpoints (gdpo-convert)"),
    "plan": ("plan", "per-GPU memory of a training config, before submitting (gdpo-plan)"),
    "doctor": ("doctor", "check this machine against the pinned stack and a config (gdpo-doctor)"),
    "plot": ("plot", "plot rewards and advantage diagnostics of runs (gdpo-plot)"),
}
PROG = "python -m gdpo_megatron"
HELP = "\n".join([f"usage: {PROG} COMMAND [ARGS ...]   ({PROG} COMMAND --help: the command's arguments)", "",
                  "commands:", *(f"  {name:<9} {what}" for name, (_, what) in COMMANDS.items())])


@console_entry
def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(HELP)
        return 0
    if not argv or argv[0] not in COMMANDS:
        got = repr(argv[0]) if argv else "nothing"
        raise UsageError(f"{PROG}: expected a command, one of {', '.join(COMMANDS)}; got {got} (see {PROG} --help)")
    return importlib.import_module(f"gdpo_megatron.commands.{COMMANDS[argv[0]][0]}").main(argv[1:])


if __name__ == "__main__":
    reexec_with_tcmalloc()
    sys.exit(main())
