"""The reference server's flags (ref_server.py; regroup_ver/ref_server_regroup.py extends them)."""
from dataclasses import dataclass

from simple_grpo.flags import flag
from simple_grpo.protocol import DEFAULT_PORT


@dataclass
class ServerConfig:
    model: str = flag("models/tiny-math", "the reference model (usually the policy's starting point)")
    host: str = flag("127.0.0.1", "the address to listen on: loopback only unless told otherwise")
    token: str = flag("", "shared secret every request must carry (default: $SIMPLE_GRPO_TOKEN); needed off loopback")
    port: int = flag(DEFAULT_PORT, "the port to listen on")
    device: str = flag("auto", "where the reference model runs: auto (the first visible GPU, else cpu), cpu, "
                               "cuda, cuda:1, ...")
    dtype: str = flag("auto", "auto (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16 or float16")
    threads: int = flag(1, "CPU threads for the reference forward pass")
    max_queue: int = flag(256, "groups waiting in each direction; /upload answers 503 when full")
    max_queue_mb: int = flag(512, "... or when the uploads held in the queues pass this many MB")
    max_body_mb: int = flag(16, "the largest upload, in MB")
    max_group_size: int = flag(256, "the most completions in one group")
    max_connections: int = flag(64, "connections served at once; more get 429 and are closed")
    conn_timeout: float = flag(60.0, "seconds a connection may stay open: slow or stalled senders are cut off")
