"""``python -m gdpo_megatron COMMAND [...]``: the console commands by name (``torchrun -m gdpo_megatron train ...``)."""
import importlib
import sys

from gdpo_megatron.commands.console import console_entry
from gdpo_megatron.commands.cpu_malloc import reexec_with_tcmalloc
from gdpo_megatron.errors import UsageError

# command -> module under gdpo_megatron.commands; each has main(argv)
COMMANDS = {"train": "train", "eval": "eval", "convert": "convert", "plan": "plan", "doctor": "doctor",
            "plot": "plot"}


@console_entry
def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        got = repr(argv[0]) if argv else "nothing"
        raise UsageError(f"python -m gdpo_megatron: expected a command, one of {', '.join(COMMANDS)}; got {got}")
    return importlib.import_module(f"gdpo_megatron.commands.{COMMANDS[argv[0]]}").main(argv[1:])


if __name__ == "__main__":
    reexec_with_tcmalloc()
    sys.exit(main())
