from typing import Callable, Sequence

import torch


def eager_and_graph_replay(step: Callable[[], Sequence[torch.Tensor]]) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    """Runs `step` once eagerly, then (after a warm-up on a side stream, as capture requires)
    captures it into a CUDA graph and replays the graph once. Returns (eager outputs, the
    captured call's outputs after the replay); a path with a host sync fails the capture."""
    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    return eager, captured
