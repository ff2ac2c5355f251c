"""The TMA tile read probe of loadtest/bench/l2_rates.py on a real GPU: its sums check every load, and
tiles that stay in L2 stream faster than tiles read from HBM once."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_l2_resident_tiles_stream_faster_than_hbm_and_a_mix_checks_every_load():
    from mok_serve.loadtest.bench.l2_rates import tile_read_rates

    props = torch.cuda.get_device_properties(0)
    sms, hit_bytes = props.multi_processor_count, props.L2_cache_size // 3
    hits = tile_read_rates(1, 0, sms, hit_bytes, calls=5)
    stream = tile_read_rates(0, 1, sms, hit_bytes, calls=5)
    assert hits["stream_tb_s"] == 0 and stream["hit_tb_s"] == 0
    assert hits["hit_tb_s"] > 1.5 * stream["stream_tb_s"] > 0
    # Two buffers and three loads per step: the call checks every program's sum itself.
    assert tile_read_rates(2, 1, sms, hit_bytes, tile_rows=128, calls=5)["stream_tb_s"] > 0
