"""JSON Schemas the structured-output tests hold answers to (random weights: every string
bounded, so a grammar-held answer always closes)."""

from __future__ import annotations

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["cat", "dog", "fish"]},
            "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                     "maxItems": 3},
            "owner": {"$ref": "#/$defs/person"},
            "size": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                               {"type": "null"}]},
        },
        "required": ["name", "kind", "owner"],
        "additionalProperties": False,
        "$defs": {"person": {"type": "object",
                             "properties": {"first": {"type": "string", "maxLength": 8},
                                            "age": {"type": "integer", "minimum": 0,
                                                    "maximum": 120}},
                             "required": ["first"], "additionalProperties": False}},
    },
    "flat": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False},
}
