"""docs/config.md from the config's field docstrings: `python -m services.runtime.config_docs > docs/config.md`."""

import ast
import dataclasses
import inspect
import textwrap
import typing

from services.runtime import config


def field_docs(cls) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), by name, the bases' first."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass.__module__ != config.__name__:
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def reference() -> str:
    """docs/config.md: every section's fields with their type, default and docstring."""
    lines = ["# Configuration reference", "",
             "Generated from `services/runtime/config.py` by `python -m services.runtime.config_docs > docs/config.md`;",
             "`tests/runtime/test_config.py` keeps it current. A file may `extends:` another (a path relative to it),",
             "its keys merged over that one's; `--set section.key=value` overrides any field from the command line.",
             "Every compiled function can be run eagerly for debugging with torch's `TORCHDYNAMO_DISABLE=1`.", ""]
    hints = typing.get_type_hints(config.MeshConfig)
    sections = [("replicas[] (every stage)", config.Replica)] + [(f.name, hints[f.name]) for f in dataclasses.fields(config.MeshConfig)]
    for name, cls in sections:
        lines += [f"## `{name}`", "", "| field | type | default | what it does |", "|---|---|---|---|"]
        types_, docs, default = typing.get_type_hints(cls), field_docs(cls), cls()
        for f in dataclasses.fields(cls):
            if f.name == "replicas" and cls is not config.Replica:
                continue
            shown = getattr(default, f.name)
            kind = str(types_[f.name]).replace("typing.", "").replace("services.runtime.config.", "")
            kind = kind.replace("<class '", "").replace("'>", "")
            lines.append(f"| `{f.name}` | `{kind}` | `{shown!r}` | {docs.get(f.name, '')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
