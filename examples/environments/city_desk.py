"""A few-step environment for the demo model's tools: weather, local time and currency.

The bundled demo model (``python -m gdpo_megatron.demo``) calls ``get_weather``, ``get_time``
and ``convert_currency`` in ``<tool_call>`` JSON; this environment answers them, so a
multi-turn run on the CPU has something to step through::

    data: {family: multi_turn, ...}
    environment:
      file: examples/environments/city_desk.py
      name: CityDesk

A question's environment config may fix the answers (``{"weather": {"Paris": "rain"}}``);
the state the multi-turn rewards compare is ``looked_up``, the queries made so far in order.
"""
from gdpo_megatron.environments import Environment

_CITY = {"type": "dict", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"name": "get_weather", "description": "The weather in a city.", "parameters": _CITY},
    {"name": "get_time", "description": "The local time in a city.", "parameters": _CITY},
    {"name": "convert_currency", "description": "Convert an amount between currencies.",
     "parameters": {"type": "dict", "properties": {"amount": {"type": "integer"}, "from": {"type": "string"},
                                                   "to": {"type": "string"}},
                    "required": ["amount", "from", "to"]}},
]


class CityDesk(Environment):
    def reset(self, config: dict) -> str:
        self.weather = dict(config.get("weather", {}))
        self.looked_up: list[str] = []
        return ""

    def tools(self) -> list[dict]:
        return TOOLS

    def call(self, name: str, arguments: dict):
        if name == "convert_currency":
            self.looked_up.append(f"{arguments['amount']} {arguments['from']}->{arguments['to']}")
            return {"amount": arguments["amount"] * 2, "currency": arguments["to"]}
        city = arguments["city"]
        self.looked_up.append(f"{name}:{city}")
        if name == "get_weather":
            return {"city": city, "weather": self.weather.get(city, "sunny")}
        return {"city": city, "time": f"{len(city) + 8:02d}:00"}
