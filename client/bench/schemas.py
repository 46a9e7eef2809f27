"""Sample JSON schemas for structured output: what the CI tests and the structured-output benchmark send.

`SCHEMAS` (name, schema): varied schemas the engine enforces (nested objects, arrays with minItems/maxItems,
enums, bounded integers and numbers, required and optional fields, booleans, nullable fields as type lists,
strings with maxLength, patterns and formats, anyOf/oneOf, $ref). Free strings carry a maxLength, arrays a
maxItems and numbers a multipleOf, so that even a tiny model sampling at temperature 1 finishes well within 512
tokens (a free decimal can run on for hundreds of digits). The steps are binary fractions (0.5, 0.25, 0.125),
which validators check exactly (0.07 is no float multiple of 0.01).

`UNSUPPORTED` (name, schema, keyword): schemas using a keyword llguidance 1.9.1 refuses ("Unimplemented
keys"); the engine answers them with a 400 whose message names the keyword.
"""

from __future__ import annotations

from typing import Any


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A closed object: every property required unless `required` says otherwise."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


def _text(max_length: int, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float, step: float = 0.25) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi, "multipleOf": step}


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("person", _obj({"name": _text(20), "age": _int(0, 120), "email": _text(40, format="email")},
                    required=["name", "age"])),
    ("address", _obj({"street": _text(30), "city": _text(20), "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                      "country": {"enum": ["FR", "DE", "US", "JP"]}})),
    ("order", _obj({
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": _obj({"sku": _text(8), "quantity": _int(1, 10), "price": _num(0, 1000)})},
        "paid": {"type": "boolean"},
    })),
    ("weather", _obj({"city": _text(20), "temperature_c": _num(-50, 60, 0.5),
                      "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}, "humidity": _int(0, 100)})),
    ("todo_list", {"type": "array", "minItems": 2, "maxItems": 4,
                   "items": _obj({"title": _text(30), "done": {"type": "boolean"},
                                  "priority": {"enum": ["low", "medium", "high"]}})}),
    ("nullable_fields", _obj({"nickname": {"type": ["string", "null"], "maxLength": 15},
                              "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 10},
                              "tags": {"type": "array", "maxItems": 3, "items": _text(10)}})),
    ("shape_any_of", _obj({"shape": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "radius": _num(0, 100, 0.5)}),
        _obj({"kind": {"const": "square"}, "side": _int(1, 50)}),
    ]}})),
    ("event_dates", _obj({"title": _text(30), "date": {"type": "string", "format": "date"},
                          "start": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                          "online": {"type": "boolean"}})),
    ("record_ids", _obj({"id": {"type": "string", "format": "uuid"},
                         "created_at": _text(32, format="date-time"), "active": {"type": "boolean"}})),
    ("matrix", _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                              "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": _int(-9, 9)}}})),
    ("server_config", _obj({
        "server": _obj({"host": _text(30, format="hostname"), "port": _int(1, 65535),
                        "tls": _obj({"enabled": {"type": "boolean"}, "version": {"enum": ["1.2", "1.3"]}})}),
        "retries": _int(0, 5),
    })),
    ("color", _obj({"name": {"enum": ["red", "green", "blue", "black", "white"]},
                    "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("exclusive_bounds", _obj({"ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                                         "multipleOf": 0.125},
                               "percent": _int(0, 100), "negative": {"type": "integer", "exclusiveMaximum": 0,
                                                                     "minimum": -1000}})),
    ("report_consts", _obj({"version": {"const": 2}, "kind": {"const": "report"},
                            "values": {"type": "array", "minItems": 1, "maxItems": 5, "items": _num(-100, 100, 0.5)}})),
    ("segment_refs", {"$defs": {"point": _obj({"x": _num(-10, 10, 0.125), "y": _num(-10, 10, 0.125)})},
                      **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})}),
    ("book_optional", _obj({"title": _text(40), "subtitle": _text(40), "pages": _int(1, 2000),
                            "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"}}, required=["title"])),
    ("catalog", _obj({"products": {"type": "array", "minItems": 1, "maxItems": 3, "items": _obj({
        "name": _text(20), "price": _num(0, 500), "in_stock": {"type": "boolean"},
        "category": {"enum": ["books", "toys", "food", "tools"]}})}})),
    ("network", _obj({"ip": {"type": "string", "format": "ipv4"}, "mask_bits": _int(0, 32),
                      "gateway": {"type": ["string", "null"], "format": "ipv4"}})),
    ("payment_one_of", _obj({"amount": _num(0, 10000), "payment": {"oneOf": [
        _obj({"method": {"const": "card"}, "last4": {"type": "string", "pattern": "^[0-9]{4}$"}}),
        _obj({"method": {"const": "cash"}}),
    ]}})),
    ("survey", _obj({"answers": {"type": "array", "minItems": 3, "maxItems": 5,
                                 "items": {"enum": ["yes", "no", "maybe"]}},
                     "rating": _int(1, 5), "comment": _text(50), "anonymous": {"type": "boolean"}},
                    required=["answers", "rating"])),
]

UNSUPPORTED: list[tuple[str, dict[str, Any], str]] = [
    ("unique_items", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ("not", _obj({"a": {"not": {"type": "string"}}}), "not"),
    ("if_then", {"type": "object", "properties": {"a": _int(0, 9)}, "if": {"properties": {"a": {"const": 1}}},
                 "then": {"required": ["a"]}}, "if"),
    ("dependent_required", {"type": "object", "properties": {"a": _int(0, 9), "b": _int(0, 9)},
                            "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ("contains", {"type": "array", "contains": {"type": "integer"}}, "contains"),
    ("property_names", {"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ("unevaluated_properties", {"type": "object", "properties": {"a": _int(0, 9)}, "unevaluatedProperties": False},
     "unevaluatedProperties"),
]
