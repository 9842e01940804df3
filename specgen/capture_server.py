"""`python -m specgen.capture_server`: a capture server for disaggregated training (`specgen.stream`).

    python -m specgen.capture_server stream.dir=STREAM model.path=TARGET [model.dtype=...] [runtime.device=cuda:1]

Loads the target once, then captures the batches that trainers (`specgen.train mode=disaggregated`) post in
stream.dir, until the run it served finishes (`stream.exit_when_done`). Start any number, on any machines that see
stream.dir, before or after the trainer; stop any of them at any time (`kill -9` included): another server
captures the batch it held. The trainer fixes the run (aux layers, target); a server whose target is not the
run's refuses it in one line.
"""

if __name__ == "__main__":  # a config error or `--cfg job` is answered before torch is imported (specgen.config)
    from specgen.config import check_command_line

    check_command_line("capture_server")

import logging
from collections.abc import Callable

from omegaconf import DictConfig

from specgen.capture import make_capture
from specgen.capture.target import TargetCapture, config_hash, load_target
from specgen.config import stage_main, to_container
from specgen.errors import SpecgenError
from specgen.progress import format_table
from specgen.runtime import resolve_device, resolve_model_dtype, set_threads
from specgen.stream import CaptureServer, FileTransport, ServerSettings, Spool
from specgen.stream.spool import OBJECTS

log = logging.getLogger("specgen.capture_server")


def run(cfg: DictConfig) -> dict:
    if cfg.stream.dir is None:
        raise SpecgenError("specgen.capture_server needs stream.dir=DIR: the stream.dir of the trainer it captures for")
    set_threads(cfg.runtime.threads)
    spool = Spool(cfg.stream.dir, stale_s=cfg.stream.stale_s)
    own_hash, build, runs_on = _target(cfg)

    def open_capture(run: dict) -> TargetCapture:
        if run["target"]["config_hash"] != own_hash:
            raise SpecgenError(f"the run on {spool.root} trains against {run['target']['path']}, whose config differs "
                               f"from model.path={cfg.model.path}: start the server with the trainer's target")
        return build(run)

    settings = ServerSettings(poll_s=cfg.stream.poll_s, exit_when_done=cfg.stream.exit_when_done,
                              idle_exit_s=cfg.stream.idle_exit_s, server_id=cfg.stream.server_id)
    server = CaptureServer(spool, FileTransport(spool.root / OBJECTS), open_capture, settings)
    log.info("capture server %s on %s (%s)", server.id, spool.root, runs_on)
    counts = server.serve()
    print(format_table([
        ("server", f"{server.id} on {spool.root}"),
        ("target", f"{cfg.model.path} ({runs_on})"),
        ("captured", f"{counts.get('captured', 0)} batches, {counts.get('tokens', 0):,} tokens"),
        ("taken over", f"{counts.get('took_over', 0)} batches whose server had gone"),
    ]))
    return counts


def _target(cfg: DictConfig) -> tuple[str, Callable[[dict], TargetCapture], str]:
    """(the target's config hash, a capture for a run's aux layers, where it runs): engine=hf loads the target once
    and makes each run's capture over it; engine=vllm starts a vLLM engine for the run (its layers are fixed at
    start), sized for the run's data.max_length."""
    if cfg.engine.name == "vllm":
        from specgen.capture.vllm import VllmCaptureSettings, load_vllm_capture, meta_target, require_vllm

        require_vllm()
        engine, started = to_container(cfg.engine), {}

        def build_vllm(run: dict) -> TargetCapture:
            """The engine this server started for an earlier run when it captures the same layers and is long enough;
            else the first engine (a run with other layers or longer samples needs a server of its own)."""
            layers, length = list(run["aux_layers"]), run["max_length"]
            if started and not (started["layers"] == layers and length <= started["length"]):
                raise SpecgenError(f"this engine=vllm server captures aux layers {started['layers']} up to "
                                   f"data.max_length {started['length']}; the run on {cfg.stream.dir} wants {layers} "
                                   f"up to {length}: start a new server for it")
            if not started:
                started.update(layers=layers, length=length, capture=load_vllm_capture(VllmCaptureSettings(
                    path=cfg.model.path, dtype=cfg.model.dtype, engine=engine, max_length=length,
                    seed=cfg.runtime.seed, aux_layers=layers)))
            return started["capture"]

        own_hash = config_hash(meta_target(cfg.model.path, cfg.model.dtype))
        return own_hash, build_vllm, f"vLLM, model.dtype={cfg.model.dtype}"
    if cfg.engine.name != "hf":
        raise SpecgenError(f"engine={cfg.engine.name} cannot serve captures; use engine=hf or engine=vllm")
    device = resolve_device(cfg.runtime.device)
    dtype = resolve_model_dtype(cfg.model.dtype, device, cfg.model.path)
    model = load_target(cfg.model.path, dtype=dtype.name, device=str(device),
                        attn_implementation=cfg.model.attn_implementation)
    return config_hash(model), lambda run: make_capture(model, list(run["aux_layers"])), f"{device}, {dtype}"


main = stage_main("capture_server")(run)

if __name__ == "__main__":
    main()
