"""The README's example, runnable: one request prefilled and decoded through a pool of
4 instances, each layer's prefix attention checked against plain attention.

    python examples/quickstart.py
"""

from __future__ import annotations

import torch

from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import load_model
from tokenlake.deploy.local import ClusterConfig, LocalCluster
from tokenlake.kernels.attention import merge, partial_attention_ref
from tokenlake.kernels.cpu import partial_attention


def fake_kv(positions: range, layer: int, model) -> torch.Tensor:
    """Stand-in for a model's K/V projections: [n, 2, kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(1000 * layer + positions.start)
    return torch.randn(len(positions), 2, model.num_kv_heads, model.head_dim, generator=g)


def main() -> float:
    model = load_model("smollm2-135m")
    prompt = tuple(range(3, 300))
    history: dict[int, torch.Tensor] = {}  # layer -> all K/V so far (for the check only)
    worst = 0.0
    config = ClusterConfig(4, model, pool_bytes=64 << 20, segment_tokens=64)  # validated here
    with LocalCluster(config) as cluster:  # or LocalCluster(4, model, pool_bytes=64 << 20, ...)
        cp = cluster.control
        steps = [BatchRequest("r1", prompt), BatchRequest("r1", (42,)), BatchRequest("r1", (7,))]
        for step, req in enumerate(steps):
            plans = cp.gen_plans([Batch((req,), "prefill" if step == 0 else "decode")], dops=[1])
            for qp, tp in zip(plans.query_plans, plans.transfer_plans):
                client = cluster.client(qp.home)
                q_buf, kv_buf = client.init_plans(qp, tp)
                span = qp.spans[0]
                rows = range(span.position, span.position + qp.num_rows)
                for layer in range(model.num_layers):
                    new_kv = fake_kv(rows, layer, model)
                    kv_buf[layer] = new_kv
                    client.put(layer)
                    q_buf[:] = torch.randn(qp.num_rows, model.num_q_heads, model.head_dim)
                    prefix = client.query(layer)
                    own = partial_attention(q_buf, new_kv[:, 0], new_kv[:, 1], causal=True)
                    o, _ = merge(prefix.o, prefix.lse, *own)
                    kv_all = torch.cat([history.get(layer, new_kv[:0]), new_kv])
                    ref, _ = partial_attention_ref(q_buf.double(), kv_all[:, 0].double(), kv_all[:, 1].double(), causal=True)
                    worst = max(worst, (o.double() - ref).abs().max().item())
                    history[layer] = kv_all
                client.wait_puts()
            cp.complete(plans)
        cp.finish_request("r1")
    print(f"3 iterations x {model.num_layers} layers through 4 instances: max |error| = {worst:.2e}")
    return worst


if __name__ == "__main__":
    main()
