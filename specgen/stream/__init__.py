"""Disaggregated training: capture servers stream the target's hidden states to trainers through a shared folder.

    python -m specgen.capture_server stream.dir=STREAM model.path=TARGET          # any number, on any machines
    python -m specgen.train mode=disaggregated stream.dir=STREAM model.path=TARGET data.path=DATA output.dir=CKPT

The trainer tokenizes the conversations and fixes the batch plan exactly as online training does; instead of
running the target itself it posts each batch it will need, a few ahead, as a *request* (token ids) into
`stream.dir`. Capture servers (the target, nothing else) claim requests, run the same capture forward as online
training and put the hidden states back as an *object*; the trainer takes the objects in plan order, trains, and
frees them. So a disaggregated run trains on bit-for-bit the batches an online run would, and needs no GPU memory
for the target on the trainer's machines.

- Control plane (`Spool`): files in `stream.dir`: the run's identity, requests, claims and server heartbeats, each
  made atomically (exclusive create or rename), which local filesystems and NFS/Lustre/GPFS honour.
- Transport (`FileTransport`): objects are safetensors files in `stream.dir/objects`, written under a temporary name
  and renamed into place; the folder may be local (one machine), a shared filesystem, or tmpfs.
- Nothing lost: a server killed mid-request leaves a claim whose process is gone or whose heartbeat stops; another
  server takes the request over. A trainer killed and resumed (`train.resume=true`) clears what the killed run left
  and posts every batch after its checkpoint again (capture is deterministic), so the resumed run ends with the
  weights of an uninterrupted one.
- Backpressure: a trainer process has at most `stream.window` requests outstanding and at most its share of
  `stream.max_bytes` (bounded by float32 sizes before capture), so the objects never exceed `stream.max_bytes`.
"""

from specgen.stream.batches import StreamBatches, StreamSettings
from specgen.stream.server import CaptureServer, ServerSettings
from specgen.stream.spool import Spool
from specgen.stream.transport import FileTransport

__all__ = ["CaptureServer", "FileTransport", "ServerSettings", "Spool", "StreamBatches", "StreamSettings"]
