from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    quantity: int = 0
    unit_price: float = 0.0


@dataclass
class Inventory:
    items: dict[str, Item] = field(default_factory=dict)

    def add_item(self, sku: str, name: str, quantity: int, unit_price: float) -> None:
        if sku in self.items:
            self.items[sku].quantity += quantity
        else:
            self.items[sku] = Item(sku, name, quantity, unit_price)

    def remove_item(self, sku: str, quantity: int) -> bool:
        item = self.items.get(sku)
        if item is None or item.quantity < quantity:
            return False
        item.quantity -= quantity
        if item.quantity == 0:
            del self.items[sku]
        return True

    def total_value(self) -> float:
        total = 0.0
        for item in self.items.values():
            total += item.quantity * item.unit_price
        return total

    def low_stock(self, threshold: int) -> list[Item]:
        return [item for item in self.items.values() if item.quantity < threshold]
