"""Normalising Python sources so that cosmetic differences do not hide duplicates."""

from __future__ import annotations

import ast
import hashlib


def normalise_source(src: str) -> str:
    """Canonical text of a Python module: comments, docstrings and layout removed.

    Falls back to whitespace-collapsed text when `src` does not parse (some scraped
    sources do not), so every source still gets a stable hash.
    """
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return " ".join(src.split())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def source_hash(src: str) -> str:
    """sha256 of the normalised source (hex, 16 chars: collisions are irrelevant at our scale)."""
    return hashlib.sha256(normalise_source(src).encode()).hexdigest()[:16]
