"""Worker side of the soak test: random values out, checksummed values in."""

from __future__ import annotations

import contextlib
import os
import random
from typing import Any

import numpy as np
import torch

import tensorwire as tw
from tests.helpers.tasks import digest

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.int32]


def random_tensor(rng: random.Random, nbytes: int) -> Any:
    dtype = rng.choice(DTYPES)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = max(0, nbytes // itemsize)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if dtype.is_floating_point:
        tensor = torch.randn(count, generator=gen).to(dtype)
    elif dtype == torch.bool:
        tensor = torch.randint(0, 2, (count,), generator=gen).bool()
    else:
        tensor = torch.randint(0, 100, (count,), generator=gen, dtype=dtype)
    if rng.random() < 0.2 and count >= 4:
        tensor = tensor[: count - count % 4].reshape(-1, 4).t()  # not contiguous
    if rng.random() < 0.15 and dtype != torch.bfloat16:
        return tensor.numpy()
    return tensor


def random_value(rng: random.Random, max_nbytes: int, depth: int = 0) -> Any:
    """A random nesting of dicts, lists and tuples holding tensors of log-uniform size."""
    if depth >= 3 or rng.random() < 0.4:
        nbytes = int(2 ** rng.uniform(0, np.log2(max_nbytes)))
        return random_tensor(rng, nbytes)
    width = rng.randint(1, 4)
    kind = rng.choice(["dict", "list", "tuple"])
    children = [random_value(rng, max_nbytes // width, depth + 1) for _ in range(width)]
    if kind == "dict":
        return {f"k{i}": child for i, child in enumerate(children)} | {"meta": rng.random()}
    return children if kind == "list" else tuple(children)


def produce(count: int, seed: int, max_nbytes: int) -> list[tuple[tw.Ref, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        value = random_value(rng, max_nbytes)
        out.append((tw.put(value), digest(value)))
    return out


def consume(items: list[tuple[tw.Ref, str]], seed: int) -> int:
    """Fetch all items concurrently with random options; the number whose checksum differs."""
    rng = random.Random(seed)
    refs = [ref for ref, _ in items]
    options = rng.choice([{}, {"transport": "host"}, {"view": True}])
    values = tw.get(refs, **options)
    return sum(digest(value) != expected for value, (_, expected) in zip(values, items, strict=True))


def fix_mmap_threshold(nbytes: int) -> int:
    """Make glibc serve every allocation of ``nbytes`` or more with its own mapping, and stop it
    raising that threshold by itself; mallopt's answer (1: done).

    By default glibc raises the threshold to the size of each mapped block freed (up to 32 MiB),
    after which blocks that size come from the heap, and random sizes leave the heap fragmented:
    here a worker's RSS then crept up about 1.3 MiB a round through a 100-round soak. With a
    fixed threshold it stayed flat (about 230 MiB), so what the soak measures is tensorwire's
    memory and not the allocator's."""
    import ctypes

    m_mmap_threshold = -3  # glibc's malloc.h
    return int(ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, nbytes))


def resources() -> dict[str, int]:
    """RSS (after returning free heap memory to the system, so that the allocator's caching
    does not read as a leak), open file descriptors and owned objects of this process."""
    import ctypes

    from tensorwire.transport.agent.core import get_agent

    agent = get_agent()
    agent.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rss": rss, "fds": len(os.listdir("/proc/self/fd")), "owned": agent.owned_objects()}


def mappings() -> dict[str, int]:
    """Mapped bytes by kind: /dev/shm segments (views) and anonymous memory."""
    shm = anon = 0
    with open("/proc/self/smaps") as f:
        current = ""
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:
                current = parts[5] if len(parts) > 5 else "anon"
            elif parts[0] == "Rss:":
                kib = int(parts[1])
                if current.startswith("/dev/shm"):
                    shm += kib
                elif current in ("anon", "[heap]"):
                    anon += kib
    return {"shm_kib": shm, "anon_kib": anon}
