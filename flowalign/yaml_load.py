"""YAML for user input: ``yaml.safe_load`` that refuses a key given twice and alias bombs.

A key repeated in one mapping (block or flow, ``{a: 1, a: 2}``) silently keeps the last value in plain PyYAML; here it is an error naming
the key and both lines. Aliases (``*name``) are shared, not copied, while parsing, but every later walk
over the data (validation, dumping) expands them: a few lines of nested aliases ("billion laughs")
expand to billions of values. The document's expanded size is counted on the parsed node graph (linear
in the file) and refused above :data:`flowalign.limits.MAX_YAML_NODES`, before anything is built.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from flowalign.errors import UserError
from flowalign.limits import MAX_YAML_NODES


class _Loader(yaml.SafeLoader):
    source = "YAML"

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base`` may be overridden on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader reports it itself
                continue
            # compared by presence, not by line: a flow mapping ``{a: 1, a: 2}`` has both keys on one line
            if first is not None:
                raise UserError(f"{self.source}: line {line}: key {key!r} is given twice in one mapping (first "
                                f"on line {first}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: Node, source: str) -> int:
    """Values of the document with every alias expanded; a self-referencing alias is refused."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise UserError(f"{source}: an alias refers to a value that contains it (line "
                            f"{node.start_mark.line + 1}); write the value out")
        active.add(key)
        children: list[Node] = []
        if isinstance(node, SequenceNode):
            children = node.value
        elif isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:  # stop counting early: the answer is already "too big"
                break
        active.discard(key)
        sizes[key] = total
        return total

    return size(root)


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML syntax error in one line: ``line N: <problem>``."""
    problem = str(getattr(err, "problem", None) or err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return f"line {mark.line + 1}: {problem}" if mark is not None else problem


def load_yaml(text: str, source: str = "YAML") -> Any:
    """The data of the YAML ``text`` (``source`` names it in errors: a file, an override); raises
    ``UserError`` for a duplicate key or an alias bomb and ``yaml.YAMLError`` for a syntax error."""
    loader = _Loader(text)
    loader.source = source
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, source) > MAX_YAML_NODES:
            raise UserError(f"{source}: its aliases (*name) expand to more than {MAX_YAML_NODES:,} values; "
                            "write the config out without nested aliases")
        return loader.construct_document(node)
    except RecursionError:
        raise UserError(f"{source}: nested too deeply to read; flatten it") from None
    finally:
        loader.dispose()
