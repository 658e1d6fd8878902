"""What the peer scripts share for sustained runs: a background sampler of the SM clock, board
power and temperature, and the sustained measurement itself (N back-to-back calls, the mean of
the last half), as examples/common/mod.rs's `sustained_run` times ours."""

import shutil
import subprocess
import threading
import time


class GpuSampler:
    """SM clock (MHz), board power (W) and temperature (C) every `period_ms`, in the background,
    so that a sustained run can say at what clock and power its time was measured."""

    def __init__(self, index, period_ms):
        self.index, self.period = index, period_ms / 1000.0
        self.samples = []          # (unix time, sm MHz, watts, temp C or None)
        self.source = None
        self._stop = threading.Event()
        self._thread = self._proc = self._nvml = None

    def start(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(self.index))
            self.source = "pynvml"
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
            return self
        except Exception:  # noqa: BLE001 -- no NVML binding: fall back on nvidia-smi
            self._nvml = None
        smi = shutil.which("nvidia-smi")
        if smi:
            # stdbuf keeps nvidia-smi's lines coming as they are written, not at exit.
            cmd = [smi, "-i", str(self.index), "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                   "--format=csv,noheader,nounits", "-lms", str(int(self.period * 1000))]
            if shutil.which("stdbuf"):
                cmd = ["stdbuf", "-oL"] + cmd
            try:
                self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                              text=True, bufsize=1)
                self.source = "nvidia-smi"
                self._thread = threading.Thread(target=self._read_smi, daemon=True)
                self._thread.start()
            except OSError:
                self._proc = None
        return self

    def _poll(self):
        nv, h = self._nvml
        while not self._stop.is_set():
            try:
                clk = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
                watts = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
                try:
                    temp = nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
                except Exception:  # noqa: BLE001
                    temp = None
                self.samples.append((time.time(), float(clk), float(watts), temp))
            except Exception:  # noqa: BLE001 -- a failed read is a missing sample
                pass
            self._stop.wait(self.period)

    def _read_smi(self):
        for line in self._proc.stdout:
            parts = [x.strip() for x in line.split(",")]
            if len(parts) < 3:
                continue
            try:
                # The arrival time stands for the sample's time: lines come as they are written.
                temp = float(parts[3]) if len(parts) > 3 and parts[3] not in ("", "[N/A]") else None
                self.samples.append((time.time(), float(parts[1]), float(parts[2]), temp))
            except ValueError:
                continue

    def stop(self):
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._nvml is not None:
            try:
                self._nvml[0].nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass

    def summary(self, t0, t1):
        """Median clock and power of the samples taken between unix times t0 and t1."""
        win = [s for s in self.samples if t0 <= s[0] <= t1]
        out = {"clock_source": self.source, "clock_samples": len(win)}
        if not win:
            return out
        def med(xs):
            return sorted(xs)[len(xs) // 2]
        clk, pw = [s[1] for s in win], [s[2] for s in win]
        temps = [s[3] for s in win if s[3] is not None]
        out.update(sm_clock_mhz_median=med(clk), sm_clock_mhz_min=min(clk),
                   power_w_median=round(med(pw), 1), power_w_max=round(max(pw), 1))
        if temps:
            out["temp_c_max"] = max(temps)
        return out


def sustained_run(call, wait, n, warmup, sampler, ev=None):
    """`call()` n times back to back after `warmup` calls; `wait(last)` blocks on a call's
    result. The first half brings clocks and power to their steady state; the second half is
    timed (CUDA events where `ev` gives a (start, end) pair, else the wall clock). Returns
    (mean ms of the first half, mean ms of the last half, sampler summary over the last half)."""
    last = None
    for _ in range(max(1, warmup)):
        last = call()
    wait(last)
    half = n // 2
    t0 = time.perf_counter()
    for _ in range(half):
        last = call()
    wait(last)
    t_mid = time.perf_counter()
    s_mid = time.time()
    if ev is not None:
        ev[0].record()
    for _ in range(n - half):
        last = call()
    if ev is not None:
        ev[1].record()
    wait(last)
    t_end, s_end = time.perf_counter(), time.time()
    first = (t_mid - t0) * 1e3 / half
    if ev is not None:
        ev[1].synchronize()
        second = ev[0].elapsed_time(ev[1]) / (n - half)
    else:
        second = (t_end - t_mid) * 1e3 / (n - half)
    return first, second, sampler.summary(s_mid, s_end)
