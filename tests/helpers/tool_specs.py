"""The function specs the tool-call tests use (engine API and server alike)."""

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 6},
                          "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
         "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
