"""Config dataclasses as command lines (cfg = parse_flags(Config, __doc__)): each field declared with
flag(default, help) is a --flag, and --help lists it under the header Config.SECTIONS starts at it."""
import argparse
from dataclasses import field, fields


def flag(default, help):
    """A dataclass field that HfArgumentParser turns into --name with this help (a % in it taken as written)."""
    return field(default=default, metadata={"help": help.replace("%", "%%")})


def flag_parser(config_class, doc=""):
    """transformers' HfArgumentParser for config_class, its options grouped under config_class.SECTIONS
    (field name -> the header that starts at it), described by the first paragraph of doc."""
    from transformers import HfArgumentParser
    parser = HfArgumentParser(config_class, description=doc.strip().split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    group = None
    for f in fields(config_class):
        if f.name in getattr(config_class, "SECTIONS", {}):
            group = parser.add_argument_group(config_class.SECTIONS[f.name])
        for action in [a for a in parser._optionals._group_actions if a.dest == f.name] if group else []:
            parser._optionals._group_actions.remove(action)  # argparse lists each option under one header
            group._group_actions.append(action)
    return parser


def parse_flags(config_class, doc="", args=None):
    """The config from the command line (or args)."""
    (cfg,) = flag_parser(config_class, doc).parse_args_into_dataclasses(args=args)
    return cfg
