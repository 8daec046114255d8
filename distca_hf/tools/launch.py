"""``distca-hf launch``: ``accelerate launch`` with a config file that carries a ``distca:`` section.

    distca-hf launch --config_file job.yaml [other accelerate launch arguments] SCRIPT [script arguments]

``accelerate launch`` (1.x) refuses config files with keys it does not know, so one file cannot
describe both the launch and distca. This command reads ``job.yaml``, checks its ``distca:``
section (a bad value fails here, before any process starts, naming the key), hands Accelerate the
file without the section, and tells every process where the section is (``DISTCA_CONFIG_FILE``):
``DistCAPlugin.from_environment()``, and so ``DistCATrainer`` / ``DistCAAccelerator`` without an
explicit plugin, read it. Precedence stays code > ``DISTCA_*`` variables > file > defaults. Every
other argument goes to ``accelerate launch`` untouched; its exit status is returned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..runtime.processes import find_flag

__all__ = ["CONFIG_FILE_VARIABLE", "main", "split_config"]

CONFIG_FILE_VARIABLE = "DISTCA_CONFIG_FILE"

def launcher_arguments(argv: list[str]) -> list[str]:
    """accelerate launch's own arguments in ``argv``: those before the job's script, module (``-m``) or
    program (``--no_python``), as accelerate's parser reads them, so that a module's own
    ``--config_file`` is left to it. All of ``argv`` when accelerate would refuse it (it then says why)."""
    import contextlib
    import io

    from accelerate.commands.launch import launch_command_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = launch_command_parser().parse_args(argv)
    except SystemExit:
        return argv
    return argv[:len(argv) - len(parsed.training_script_args) - 1]


def split_config(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(accelerate settings, distca section)`` of a YAML config file; the section is validated."""
    from ..training.plugin import load_config_yaml, read_distca_section

    section = read_distca_section(path)  # checks the file, the mapping and every distca key
    document = load_config_yaml(path) or {}
    document.pop("distca", None)
    return document, section


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    own = launcher_arguments(argv)
    found = find_flag(own, "config_file")
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="distca-launch-") as tmp:
        if found is not None:
            index, path = found
            if not path:  # (read as the current folder before)
                raise SystemExit("distca-hf launch: error: --config_file is empty; name the accelerate config file")
            rest = own[index + (1 if "=" in own[index] else 2):]
            if find_flag(rest, "config_file") is not None:  # accelerate reads the last, distca read the first
                raise SystemExit("distca-hf launch: error: --config_file is given twice; give it once")
            try:
                accelerate_settings, _ = split_config(path)
            except (OSError, ValueError) as e:  # a missing, unreadable or bad file, named before any process starts
                raise SystemExit(f"distca-hf launch: error: --config_file: {e}") from None
            import yaml

            stripped = Path(tmp) / Path(path).name
            stripped.write_text(yaml.safe_dump(accelerate_settings))
            env[CONFIG_FILE_VARIABLE] = str(Path(path).resolve())
            if "=" in argv[index]:
                argv[index] = f"--config_file={stripped}"
            else:
                argv[index + 1] = str(stripped)
        return subprocess.call([sys.executable, "-m", "accelerate.commands.launch", *argv], env=env)


if __name__ == "__main__":
    sys.exit(main())
