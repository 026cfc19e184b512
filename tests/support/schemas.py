"""JSON schemas of the kinds applications send (extraction from an image, events, settings), none
of them special to the code: every constrained answer must parse and validate against its own."""

SHORT = {"type": "string", "maxLength": 6}

SCHEMAS = {
    "receipt": {"type": "object", "properties": {
        "store": SHORT, "total": {"type": "number", "minimum": 0, "maximum": 1000},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "name": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["name", "qty"], "additionalProperties": False}, "minItems": 1, "maxItems": 3}},
        "required": ["store", "total", "items"], "additionalProperties": False},
    "meter": {"type": "object", "properties": {"reading": {"type": "integer", "minimum": 0, "maximum": 99999},
                                               "unit": {"enum": ["kWh", "m3", "L"]}},
              "required": ["reading", "unit"], "additionalProperties": False},
    "shelf": {"type": "object", "properties": {"counts": {"type": "array", "minItems": 2, "maxItems": 4,
                                                          "items": {"type": "integer", "minimum": 0, "maximum": 50}}},
              "required": ["counts"], "additionalProperties": False},
    "camera_event": {"type": "object", "properties": {
        "kind": {"enum": ["person", "car", "animal", "none"]}, "confidence": {"type": "number", "minimum": 0,
                                                                          "maximum": 1},
        "box": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 999},
                                              "minItems": 4, "maxItems": 4}]}},
        "required": ["kind", "confidence", "box"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 5},
                                                  "ok": {"type": "boolean"}},
                 "required": ["note", "ok"], "additionalProperties": False},
    "const_and_nested": {"type": "object", "properties": {
        "version": {"const": 2}, "inner": {"type": "object", "properties": {
            "deep": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -3, "maximum": 3}},
                     "required": ["x"], "additionalProperties": False}},
            "required": ["deep"], "additionalProperties": False}},
        "required": ["version", "inner"], "additionalProperties": False},
    "string_lengths": {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3},
                                                        "tag": {"type": "string", "minLength": 1, "maxLength": 4}},
                       "required": ["code", "tag"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"plate": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                                 "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]$"}},
                "required": ["plate", "date"], "additionalProperties": False},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9},
                                                                   "y": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
             "required": ["a", "b"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5},
                                                         "b": {"enum": [True, None, "x"]}},
                        "required": [], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
                        "maxItems": 5},
    "top_level_enum": {"enum": ["cat", "dog", 3, None]},
    "exclusive_range": {"type": "object", "properties": {"t": {"type": "integer", "exclusiveMinimum": 10,
                                                               "exclusiveMaximum": 13}},
                        "required": ["t"], "additionalProperties": False},
    "one_of": {"oneOf": [{"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}},
                          "required": ["circle"], "additionalProperties": False},
                         {"type": "object", "properties": {"square": {"type": "boolean"}},
                          "required": ["square"], "additionalProperties": False}]},
}
