"""A JSON schema's ``$ref`` graph, walked without recursion: how deep it nests once every
reference is followed, and whether a required field leads back to itself (no finite JSON value
then satisfies the schema, and llguidance would force output until it runs out of items)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote


def resolve(root: Any, ref: str) -> Any | None:
    """The schema a local ``$ref`` (``#``, ``#/$defs/Name``, any JSON pointer) names in
    ``root``; None for a remote or unresolvable one (llguidance reports those)."""
    if not ref.startswith("#"):
        return None
    node = root
    pointer = unquote(ref[1:])
    if not pointer:
        return node
    if not pointer.startswith("/"):
        return None
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _subschemas(node: dict, root: Any) -> list[dict]:
    """The dicts directly inside ``node`` (through lists), and its ``$ref``'s target."""
    out: list[dict] = []
    pending: list[Any] = list(node.values())
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            out.append(value)
        elif isinstance(value, list):
            pending.extend(value)
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = resolve(root, ref)
        if isinstance(target, dict):
            out.append(target)
    return out


def _forced(node: dict, root: Any) -> list[dict]:
    """The schemas every instance of ``node`` must also contain an instance of: its ``$ref``,
    ``allOf``, required properties, and the items of an array with ``minItems`` >= 1."""
    out: list[Any] = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        out.append(resolve(root, ref))
    if isinstance(node.get("allOf"), list):
        out.extend(node["allOf"])
    props, required = node.get("properties"), node.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        out.extend(props.get(name) for name in required if isinstance(name, str))
    min_items = node.get("minItems")
    if isinstance(min_items, int) and not isinstance(min_items, bool) and min_items >= 1:
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        out.extend(prefix[:min_items])
        if min_items > len(prefix):
            out.append(node.get("items"))
    return [s for s in out if isinstance(s, dict)]


def _longest(root: dict, children, on_cycle) -> int:
    """Longest chain of ``children`` from ``root``, a node counting once; ``on_cycle(node)`` is
    called when a chain comes back to a node it holds (and returns whether to go on)."""
    done: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[dict, list[dict], int]] = [(root, children(root), 0)]
    on_path.add(id(root))
    while stack:
        node, todo, best = stack[-1]
        if todo:
            child = todo.pop()
            key = id(child)
            if key in done:
                stack[-1] = (node, todo, max(best, done[key]))
            elif key in on_path:
                on_cycle(child)
            else:
                on_path.add(key)
                stack.append((child, children(child), 0))
            continue
        stack.pop()
        on_path.discard(id(node))
        done[id(node)] = depth = best + 1
        if stack:
            parent, parent_todo, parent_best = stack[-1]
            stack[-1] = (parent, parent_todo, max(parent_best, depth))
    return done[id(root)]


def check_refs(schema: Any, max_depth: int, where: str) -> None:
    """Raise ``ValueError`` (``where: why``) if ``schema``, with its ``$ref``s followed, nests
    deeper than ``max_depth`` schemas, or a required field refers back to itself."""
    if not isinstance(schema, dict):
        return

    def cyclic(node: dict) -> None:
        raise ValueError(f"{where}: a required field (or $ref, allOf, minItems) refers back to "
                         "itself, so no finite JSON value satisfies the schema")

    _longest(schema, lambda n: _forced(n, schema), cyclic)
    depth = _longest(schema, lambda n: _subschemas(n, schema), lambda n: None)
    if depth > max_depth:
        raise ValueError(f"{where}: expected schemas nested at most {max_depth} deep with "
                         f"every $ref followed, got {depth}")


__all__ = ["check_refs", "resolve"]
