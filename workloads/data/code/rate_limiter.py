import time


class TokenBucket:
    """Allows `capacity` events at once and `refill_rate` events per second on average."""

    def __init__(self, capacity: int, refill_rate: float) -> None:
        self.capacity = capacity
        self.refill_rate = refill_rate
        self.tokens = float(capacity)
        self.last_refill = time.monotonic()

    def refill(self) -> None:
        now = time.monotonic()
        elapsed = now - self.last_refill
        self.tokens = min(self.capacity, self.tokens + elapsed * self.refill_rate)
        self.last_refill = now

    def try_acquire(self, count: int = 1) -> bool:
        self.refill()
        if self.tokens >= count:
            self.tokens -= count
            return True
        return False

    def wait_time(self, count: int = 1) -> float:
        self.refill()
        missing = count - self.tokens
        if missing <= 0:
            return 0.0
        return missing / self.refill_rate


def acquire_blocking(bucket: TokenBucket, count: int = 1) -> None:
    while not bucket.try_acquire(count):
        time.sleep(bucket.wait_time(count))
