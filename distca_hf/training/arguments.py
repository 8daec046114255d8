"""``DistCAArguments``: the distca settings as command-line flags, for ``transformers.HfArgumentParser``.

    from transformers import HfArgumentParser, TrainingArguments
    parser = HfArgumentParser((TrainingArguments, DistCAArguments))
    training_args, distca_args = parser.parse_args_into_dataclasses()
    trainer = DistCATrainer(..., args=training_args, distca_plugin=distca_args.plugin())

One flag per setting of the table in ``distca_hf.config`` (same name, help, choices and check;
``--tolerance 0.05``, ``--overlap pingpong``, ``--servers 0 1``, ``--span_ranks false``), plus
``--distca_config`` (a YAML file with a ``distca:`` section). A flag left out is not set: the
setting's ``DISTCA_*`` variable, else the file, else the table's default decides, as for
``DistCAPlugin``. Importing this module is cheap (no torch), so ``--help`` is quick.
"""

from __future__ import annotations

from dataclasses import field, make_dataclass
from typing import Literal, Optional

from ..config import SETTINGS, none_is_a_value, read_setting_text, stands_for_none

__all__ = ["DistCAArguments"]

_PLAIN_TYPES = {"float": float, "int": int, "str": str, "bool": bool}


def _flag_type(name: str, setting) -> type:
    """The type ``HfArgumentParser`` turns into the flag: choices as a ``Literal``, a tuple of ranks
    as ``list[int]``, a plain type (``float``, ``int``, ``bool``, ``str``, optionally ``| None``) as
    itself; any other setting (e.g. ``float | str``) takes the text of its ``DISTCA_*`` variable,
    read by the table's own ``parse`` (``_TEXT_SETTINGS``)."""
    choices = getattr(setting.metadata["check"], "choices", None)
    if choices:
        return Literal[choices]
    annotation = str(setting.type)
    if annotation.startswith("tuple[int"):
        return list[int]
    kinds = [part.strip() for part in annotation.split("|") if part.strip() != "None"]
    # a setting whose None is a value of its own takes text ("none" as its variable spells it; a float flag
    # refused it)
    if len(kinds) == 1 and kinds[0] in _PLAIN_TYPES and not none_is_a_value(name):
        return _PLAIN_TYPES[kinds[0]]
    return str


def _sentence(text: str) -> str:
    text = text.strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


_TRAINER_DEFAULTS = {"span_ranks": "on when the server group has more than one rank (DistCATrainer's and "
                                    "DistCASFTTrainer's choice; False elsewhere)"}
"""Settings whose default the trainers choose themselves (``global_batches``), said in the flag's help."""


def _flag_help(name: str, setting) -> str:
    variable = setting.metadata["env"]
    unset = f"{variable}, else " if variable else ""
    # a None default means something per setting (block: by device; time_model: built-in), said in its help
    default = "the setting's own None (see above)" if setting.default is None else repr(setting.default)
    default = _TRAINER_DEFAULTS.get(name, default)
    return (f"{_sentence(setting.metadata['help'])} Left out (None): {unset}the distca: section of "
            f"--distca_config, else {default}.")


def _setting_field(name: str, setting):
    metadata = {"help": _flag_help(name, setting)}
    flag_type = _flag_type(name, setting)
    if flag_type is bool:  # a bare --span_ranks means true, as transformers' own optional flags do
        metadata.update(nargs="?", const=True)
    return name, Optional[flag_type], field(default=None, metadata=metadata)


def _plugin(self, **overrides):
    """The ``DistCAPlugin`` these flags describe; ``overrides`` (settings) beat the flags."""
    from .plugin import DistCAPlugin

    given = {name: getattr(self, name) for name in SETTINGS if getattr(self, name) is not None}
    for name in _TEXT_SETTINGS & given.keys():
        if stands_for_none(name, given[name]):  # kept as the word: the plugin's None means "not set"
            continue
        try:
            given[name] = read_setting_text(name, str(given[name]))
        except ValueError as error:
            raise ValueError(f"invalid --{name} {given[name]!r}: distca {name} {error}") from None
    given.update(overrides)
    if self.distca_config:
        return DistCAPlugin.from_accelerate_config(self.distca_config, **given)
    return DistCAPlugin.from_environment(**given)


_TEXT_SETTINGS = frozenset(name for name, setting in SETTINGS.items()
                           if _flag_type(name, setting) is str and str(setting.type) != "str")
"""Settings whose flag takes text, read as their variable is (``config.read_setting_text``)."""

DistCAArguments = make_dataclass(
    "DistCAArguments",
    [_setting_field(name, setting) for name, setting in SETTINGS.items()] + [
        ("distca_config", Optional[str], field(default=None, metadata={
            "help": "A YAML file with a distca: section (e.g. recipes/distca.yaml): settings below the flags and "
                    "the DISTCA_* variables in precedence. Left out: the file `distca-hf launch` names, if any."})),
    ],
    namespace={"plugin": _plugin, "__module__": __name__},
)
DistCAArguments.__doc__ = """The distca settings as ``HfArgumentParser`` flags (see the module docstring); ``plugin()``
gives the ``DistCAPlugin`` they describe."""
