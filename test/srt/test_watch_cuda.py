"""GPU: the family watch adds no host synchronisation (``torch.cuda.set_sync_debug_mode("error")``
turns any synchronising CUDA call into an error). Only the watch's hook bodies run under it:
sglang itself synchronises elsewhere. Skipped without CUDA."""

import unittest

import torch

from sglang_dsa_fix import watch


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
class TestWatchAddsNoSync(unittest.TestCase):
    def setUp(self):
        watch.reset()
        self.addCleanup(watch.reset)
        self.addCleanup(torch.cuda.set_sync_debug_mode, "default")

    def test_row_write_check_never_synchronises(self):
        site = watch.Site(watch.ROW_WRITE, "test.writer", "req_to_token", slot=0)
        pool = torch.zeros((4, 300), dtype=torch.int32, device="cuda")
        start = torch.tensor([250, 10, 290], dtype=torch.int64, device="cuda")
        end = torch.tensor([306, 20, 290], dtype=torch.int64, device="cuda")  # row 0: 6 past, row 2: none
        watch._counters(torch.device("cuda", torch.cuda.current_device()))  # the once-per-device allocation
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(100):
            watch._check_rows(site, pool, start, end, 3)
        torch.cuda.set_sync_debug_mode("default")
        counters = watch._DEVICE_COUNTERS[end.device][0].tolist()
        self.assertEqual(counters[:2], [100, 600])
        self.assertEqual(counters[2], 306)


if __name__ == "__main__":
    unittest.main()
