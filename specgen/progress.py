"""Progress bar and the end-of-run summary, so a long generation shows rate and ETA and ends with numbers."""

import time

from tqdm.auto import tqdm


class Progress:
    """Rows done out of the total (when known), tokens/s and ETA, on one line."""

    def __init__(self, total_rows: int | None, *, enabled: bool = True, desc: str = "generate"):
        self.bar = tqdm(total=total_rows, unit="row", desc=desc, disable=not enabled, dynamic_ncols=True)
        self.start = time.perf_counter()
        self.tokens = 0

    def update(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        self.bar.update(rows)

    def close(self) -> float:
        self.bar.close()
        return time.perf_counter() - self.start


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
