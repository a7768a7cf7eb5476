"""Capturing a call in a CUDA graph the way the GPU tests need it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``step`` once on a side stream (compiling its kernels outside the capture), then
    capture one more call in a CUDA graph. Returns ``(graph, what the captured call
    returned)``: each ``graph.replay()`` reruns it on what its input tensors hold then."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result
