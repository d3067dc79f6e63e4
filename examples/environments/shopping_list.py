"""An environment of your own: a shopping list the model edits through three functions.

Name it in the config::

    environment:
      file: examples/environments/shopping_list.py
      name: ShoppingList

A question's environment config (its data row's ``environment_config``) gives the list to
start from, e.g. ``{"items": {"milk": 1}}``. The state the multi-turn rewards compare is the
public attribute ``items`` (the default ``state()``); the environment is deterministic, so the
rewards can replay a trajectory's calls in a fresh instance.
"""
from gdpo_megatron.environments import Environment

TOOLS = [
    {"name": "add_item", "description": "Add a number of an item to the list.",
     "parameters": {"type": "dict", "properties": {"item": {"type": "string"}, "count": {"type": "integer"}},
                    "required": ["item"]}},
    {"name": "remove_item", "description": "Remove an item from the list.",
     "parameters": {"type": "dict", "properties": {"item": {"type": "string"}}, "required": ["item"]}},
    {"name": "show_list", "description": "The items on the list and their counts.",
     "parameters": {"type": "dict", "properties": {}, "required": []}},
]


class ShoppingList(Environment):
    def reset(self, config: dict) -> str:
        self.items = dict(config.get("items", {}))
        return ""

    def tools(self) -> list[dict]:
        return TOOLS

    def call(self, name: str, arguments: dict):
        if name == "add_item":
            count = arguments.get("count") or 1
            if count < 1:
                raise ValueError("count must be at least 1")
            self.items[arguments["item"]] = self.items.get(arguments["item"], 0) + count
            return {"items": self.items}
        if name == "remove_item":
            if arguments["item"] not in self.items:
                raise KeyError(f"{arguments['item']} is not on the list")
            del self.items[arguments["item"]]
            return {"items": self.items}
        return {"items": self.items}
