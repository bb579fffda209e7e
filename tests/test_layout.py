"""--api-servers: the layout a config resolves to, and the frames that cross (no processes)."""

from __future__ import annotations

import pytest

from imp.config import ServerConfig, api_servers
from imp.engine import wire
from imp.engine.port import Submission
from imp.messages import Delta, Reject, SamplingParams, TokenOut


def test_auto_is_one_process_on_cpu_and_api_servers_on_a_gpu_host():
    assert api_servers(ServerConfig(), 2) == 0 and api_servers(ServerConfig(), 64) == 0  # CPU: the cores run the model
    assert api_servers(ServerConfig(device="cuda:0"), 2) == 0
    assert api_servers(ServerConfig(device="cuda:0"), 16) == 1
    assert api_servers(ServerConfig(device="cuda:0"), 128) == 4
    assert api_servers(ServerConfig(api_servers=3), 2) == 3  # asked for: as asked
    with pytest.raises(ValueError, match="--api-servers"):
        ServerConfig(api_servers=65)


def test_frames_round_trip_in_one_message():
    sub = Submission(req_id="r1", prompt=(1, 2, 3), params=SamplingParams(max_tokens=4), n=2, stop=("x",))
    d = Delta(TokenOut("r1", 1, (7, 8), completion_tokens=2), "")
    frames = [wire.Hello(0, 123), wire.Open(sub), wire.Items((d, Reject("r2", 429, "queue_full", "full"))),
              wire.Call(5, "suspend", (1.5,)), wire.Answer(5, wire.raw({"ok": True})), wire.Bye()]
    back = wire.decode(wire.encode(frames))
    assert back[:4] == frames[:4] and type(back[5]) is wire.Bye
    assert wire.value(back[4], dict) == {"ok": True}


def test_gpu_activations_is_validated_and_reaches_the_cli():
    import argparse

    from imp.config import add_serve_args, config_from_args

    assert ServerConfig().gpu_activations == "int8"
    from imp.config import gpu_runner_options

    # the server's loader and bench/gpu.py's default rows take the runner's numerics from here (issue 39: the bench
    # had measured fp32 activations while the server ran int8)
    assert gpu_runner_options(ServerConfig(device="cuda:0")) == {"int8_act": True, "batch_invariant": False,
                                                                 "decode_attention": "auto"}
    assert gpu_runner_options(ServerConfig(gpu_activations="fp32"))["int8_act"] is False
    # the decode rows' attention kernel (issue 39's split decode), validated once here and passed to the runner
    assert gpu_runner_options(ServerConfig(gpu_decode_attention="paged"))["decode_attention"] == "paged"
    with pytest.raises(ValueError, match="--gpu-decode-attention"):
        ServerConfig(gpu_decode_attention="flash")
    # auto, resolved per model by the runner: mma at head dim 128 on a bf16 cache (the 8B shape), split else
    import torch

    from imp.gpu.runner import decode_kernel

    assert decode_kernel("auto", 32, 8, 128, torch.bfloat16) == "mma"
    assert decode_kernel("auto", 9, 3, 64, torch.bfloat16) == "split"  # SmolLM2: mma measured slower at short contexts
    assert decode_kernel("auto", 32, 8, 128, torch.float32) == "split"  # mma reads bf16 caches only
    assert decode_kernel("auto", 4, 1, 256, torch.bfloat16) == "split"
    assert decode_kernel("mma", 9, 3, 64, torch.bfloat16) == "mma" and decode_kernel("paged", 32, 8, 128, None) == "paged"
    with pytest.raises(ValueError, match="--gpu-activations"):
        ServerConfig(gpu_activations="int4")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert config_from_args(p.parse_args(["--gpu-activations", "fp32"])).gpu_activations == "fp32"
    with pytest.raises(SystemExit):
        p.parse_args(["--gpu-activations", "fp16"])
