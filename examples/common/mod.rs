//! What the device examples share: their arguments, the device, and the results file of
//! docs/ARCHITECTURE.md (date, device, commit, rows).
#![allow(dead_code)] // each example uses its own part

mod spin;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;
use flashattn::cuda::{CudaStream, Device};
use flashattn::DeviceInfo;

/// The command line: flags (`--quick`) and options with a value (`--out PATH`).
pub struct Args(Vec<String>);

impl Args {
    pub fn parse() -> Args {
        Args(std::env::args().collect())
    }
    pub fn flag(&self, name: &str) -> bool {
        self.0.iter().any(|a| a == name)
    }
    /// A switch given as `on` or `off`: Some(true), Some(false), or None when neither is given;
    /// exits 2 when both are.
    pub fn switch(&self, on: &str, off: &str) -> Option<bool> {
        match (self.flag(on), self.flag(off)) {
            (true, true) => {
                eprintln!("{on} and {off} contradict each other");
                std::process::exit(2)
            }
            (true, false) => Some(true),
            (false, true) => Some(false),
            (false, false) => None,
        }
    }
    /// The argument after `name`, if `name` is given; exits 2 when nothing follows it.
    pub fn value(&self, name: &str) -> Option<String> {
        let i = self.0.iter().position(|a| a == name)?;
        match self.0.get(i + 1) {
            Some(v) => Some(v.clone()),
            None => {
                eprintln!("{name} takes a value");
                std::process::exit(2)
            }
        }
    }
    /// `--only D,S[,WORD...]`, one shape for profilers: D a head dim the kernels are built for
    /// (64, 128, 256), S > 0 dividing `tokens`, each WORD one of `words`; exits 2 on anything
    /// else. Returns D, S and the words given.
    pub fn only(&self, tokens: usize, words: &[&str]) -> Option<(usize, usize, Vec<String>)> {
        let v = self.value("--only")?;
        let f: Vec<&str> = v.split(',').collect();
        let num = |i: usize| f.get(i).and_then(|x| x.parse::<usize>().ok());
        match (num(0), num(1)) {
            (Some(d), Some(s))
                if [64, 96, 128, 192, 256].contains(&d)
                    && s > 0
                    && tokens % s == 0
                    && f[2..].iter().all(|w| words.contains(w)) =>
            {
                Some((d, s, f[2..].iter().map(|w| w.to_string()).collect()))
            }
            _ => {
                eprintln!(
                    "--only takes D,S[,{}]: D 64, 96, 128, 192 or 256, S dividing {tokens}",
                    words.join("][,")
                );
                std::process::exit(2)
            }
        }
    }
    /// `--sustained N`: N back-to-back calls per shape and kind (see `sustained_run`), N ≥ 4 as
    /// benchmarks/peers_fa3_fp8.py takes it (each half holds at least two calls); exits 2 on
    /// anything else.
    pub fn sustained(&self) -> Option<usize> {
        match self.value("--sustained").map(|v| v.parse::<usize>()) {
            Some(Ok(n)) if n >= 4 => Some(n),
            Some(_) => {
                eprintln!("--sustained takes a count N >= 4");
                std::process::exit(2)
            }
            None => None,
        }
    }
    /// `--commit SHA`, or "unknown".
    pub fn commit(&self) -> String {
        self.value("--commit").unwrap_or_else(|| "unknown".into())
    }
}

/// Device 0, or exit 2 with a message naming the example.
pub fn device(example: &str) -> Device {
    Device::new(0).unwrap_or_else(|e| {
        eprintln!("{example} needs a CUDA device: {e}");
        std::process::exit(2)
    })
}

/// Today's date as `date +%Y-%m-%d` prints it (empty if `date` cannot run).
pub fn today() -> String {
    let out = std::process::Command::new("date").arg("+%Y-%m-%d").output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The device as results files name it.
pub fn describe(info: &DeviceInfo) -> String {
    format!(
        "{} (sm_{}{}, {} SMs)",
        info.name, info.major, info.minor, info.sm_count
    )
}

/// Writes `{"date", "device", "commit", <extra>, "rows": [...]}` to `path`; each row is one
/// JSON object already formatted.
pub fn write_results(path: &str, device: &str, commit: &str, extra: &str, rows: &[String]) {
    store_results(path, device, commit, extra, rows);
    println!("wrote {path}");
}

/// [`write_results`] without a word: for a file written again after every row.
pub fn store_results(path: &str, device: &str, commit: &str, extra: &str, rows: &[String]) {
    let json = format!(
        "{{\"date\": \"{}\", \"device\": \"{device}\", \"commit\": \"{commit}\"{extra}, \"rows\": [\n{}\n]}}\n",
        today(),
        rows.join(",\n")
    );
    std::fs::write(path, json).expect("write results");
}

/// A timing event recorded on `stream` now.
pub fn timing_event(stream: &Arc<CudaStream>) -> CudaEvent {
    stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap()
}

/// How a cold measurement is taken, as benchmarks/peers_common.py takes the peers' (its
/// `--warmup`, `--min-reps`, `--max-reps`, `--target-ms`, `--cool-ms`): `warmup` queued calls,
/// three probe calls, then as many timed calls as make about `target_ms` of GPU time (the count
/// rounded down and held to `min_reps`..=`max_reps`; alternating ways share those calls, each
/// taking at least `min_reps`), median interpolated as theirs. The probe and the timed calls
/// each queue behind a spin of [`head_ms`] on the stream, as the peers' behind
/// `torch.cuda._sleep`: the GPU's clocks fall as a run nears its power cap and rise again at
/// rest, so our rows and the peers' must start from the same rest and span the same time to be
/// compared.
#[derive(Clone, Copy, Debug)]
pub struct Protocol {
    pub warmup: usize,
    pub min_reps: usize,
    pub max_reps: usize,
    pub target_ms: f64,
    /// The shortest rest before a timed loop.
    pub cool_ms: f64,
}

/// One measurement under a [`Protocol`]: each way's sorted milliseconds, the calls timed per way,
/// and the host's enqueue time per call in microseconds.
pub struct Timed {
    pub ms: Vec<Vec<f64>>,
    pub reps: usize,
    pub host_us: f64,
}

/// The p-th percentile (0..=100) of sorted values, interpolated between neighbours as
/// benchmarks/peers_common.py's `percentile`.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let pos = (sorted.len() - 1) as f64 * p / 100.0;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// The spin ahead of a loop of `calls` calls, as benchmarks/peers_common.py's `head_ms`: long
/// enough for the host to queue them all (1.5 × their enqueue time), at least `cool_ms`, at
/// most a second.
pub fn head_ms(calls: usize, host_ms_per_call: f64, cool_ms: f64) -> f64 {
    (1.5 * calls as f64 * host_ms_per_call)
        .max(cool_ms)
        .min(1000.0)
}

impl Protocol {
    /// The peers' flags on the command line, over these defaults; `--quick` caps the target at
    /// 100 ms and the fewest runs at 20, as compare_torch.py's and peers_fa3_fp8.py's `--quick`
    /// does. Exits 2 on a bad value.
    pub fn from_args(args: &Args, default: Protocol) -> Protocol {
        let num = |name: &str, dflt: f64| match args.value(name).map(|v| v.parse::<f64>()) {
            None => dflt,
            Some(Ok(x)) if x >= 0.0 => x,
            Some(_) => {
                eprintln!("{name} takes a number >= 0");
                std::process::exit(2)
            }
        };
        let mut p = Protocol {
            warmup: num("--warmup", default.warmup as f64) as usize,
            min_reps: num("--min-reps", default.min_reps as f64) as usize,
            max_reps: num("--max-reps", default.max_reps as f64) as usize,
            target_ms: num("--target-ms", default.target_ms),
            cool_ms: num("--cool-ms", default.cool_ms),
        };
        if args.flag("--quick") {
            p.target_ms = p.target_ms.min(100.0);
            p.min_reps = p.min_reps.min(20);
        }
        if p.min_reps == 0 || p.max_reps < p.min_reps {
            eprintln!("need 1 <= --min-reps <= --max-reps");
            std::process::exit(2)
        }
        p
    }

    /// As it goes into a results file.
    pub fn json_fields(&self) -> String {
        format!(
            "\"warmup\": {}, \"min_reps\": {}, \"max_reps\": {}, \"target_ms\": {}, \"cool_ms\": {}",
            self.warmup, self.min_reps, self.max_reps, self.target_ms, self.cool_ms
        )
    }

    /// `ways` calls timed under the protocol, their calls alternating ([`interleaved_times_ms`]).
    pub fn times_ms(
        &self,
        stream: &Arc<CudaStream>,
        ways: usize,
        mut call: impl FnMut(usize),
    ) -> Timed {
        for _ in 0..self.warmup.max(1) {
            (0..ways).for_each(&mut call);
        }
        // The peers' first estimate of their enqueue time per call.
        let (probe, host_us) = self.held_times_ms(stream, 3, ways, 500.0, &mut call);
        // The calls of one loop as the peers count them (of the ways' mean call), shared by the
        // ways: the loop spans the time one peer's does, whatever the number of ways.
        let call_ms = probe.iter().map(|ms| ms[1]).sum::<f64>() / ways as f64;
        let calls =
            ((self.target_ms / call_ms.max(1e-3)) as usize).clamp(self.min_reps, self.max_reps);
        let reps = calls.div_ceil(ways).max(self.min_reps);
        let (ms, host_us) = self.held_times_ms(stream, reps, ways, host_us, call);
        Timed { ms, reps, host_us }
    }

    /// [`interleaved_times_ms`] behind the spin ([`head_ms`] for an enqueue time of
    /// `host_us_per_call`), after the stream's earlier work.
    fn held_times_ms(
        &self,
        stream: &Arc<CudaStream>,
        reps: usize,
        ways: usize,
        host_us_per_call: f64,
        call: impl FnMut(usize),
    ) -> (Vec<Vec<f64>>, f64) {
        stream.synchronize().unwrap();
        let head = head_ms(reps * ways, host_us_per_call.max(50.0) * 1e-3, self.cool_ms);
        spin::hold(stream, head);
        interleaved_times_ms(stream, reps, ways, call)
    }

    /// The median milliseconds of one call under the protocol, and the calls timed.
    pub fn median_ms(&self, stream: &Arc<CudaStream>, mut call: impl FnMut()) -> (f64, usize) {
        let t = self.times_ms(stream, 1, |_| call());
        (percentile(&t.ms[0], 50.0), t.reps)
    }
}

/// Milliseconds of `reps` rounds of `ways` calls taken in turn (`call(0)`, `call(1)`, ..., then
/// again), each between CUDA events: each way's sorted milliseconds, and the host's time to
/// enqueue one call (with its events) in microseconds. The calls stay queued (one synchronization
/// at the end), so that behind work already on the stream (the protocol's spin) the host
/// enqueues them while the GPU is still busy and no launch gap is timed. A drift of the clocks or the power
/// state over the run then falls on every way alike, which timing one after the other cannot give.
pub fn interleaved_times_ms(
    stream: &Arc<CudaStream>,
    reps: usize,
    ways: usize,
    mut call: impl FnMut(usize),
) -> (Vec<Vec<f64>>, f64) {
    let event = || timing_event(stream);
    let host_start = std::time::Instant::now();
    let events: Vec<_> = (0..reps)
        .flat_map(|_| 0..ways)
        .map(|way| {
            let start = event();
            call(way);
            (way, start, event())
        })
        .collect();
    let host_us = host_start.elapsed().as_secs_f64() * 1e6 / (reps * ways).max(1) as f64;
    stream.synchronize().unwrap();
    let mut ms = vec![Vec::with_capacity(reps); ways];
    for (way, start, end) in &events {
        ms[*way].push(start.elapsed_ms(end).unwrap() as f64);
    }
    for way in &mut ms {
        way.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    (ms, host_us)
}

/// Untimed calls before a sustained run, as benchmarks/peers_fa3_fp8.py's default
/// `--sustained-warmup`: they fill the queue so that the run starts on a busy GPU.
pub const SUSTAINED_WARMUP: usize = 20;

/// One sustained measurement (`sustained_run`): the mean per call of each half of `reps`
/// back-to-back calls, and the clocks over the second half.
pub struct Sustained {
    pub reps: usize,
    pub ms_first_half: f64,
    /// The reported time: the mean per call over the last half.
    pub ms: f64,
    /// None without a sampler (no nvidia-smi).
    pub clocks: Option<ClockSummary>,
}

impl Sustained {
    /// The fields of a sustained row after its shape's, as benchmarks/peers_fa3_fp8.py writes
    /// them: `kind` names the time fields (`fwd_ms`, `bwd_ms`, ...), `flops` is one call's.
    pub fn json_fields(&self, kind: &str, flops: f64) -> String {
        format!(
            "\"sustained\": true, \"reps\": {}, \"kind\": \"{kind}\", \"timing\": \"CUDA events over the last half\", \"{kind}_ms\": {:.4}, \"{kind}_ms_first_half\": {:.4}, \"{kind}_tflops\": {:.1}{}",
            self.reps,
            self.ms,
            self.ms_first_half,
            flops / (self.ms * 1e-3) / 1e12,
            self.clocks.as_ref().map_or(String::new(), ClockSummary::json_fields)
        )
    }
    /// The same for the printed table: time, TFLOP/s, the first half's time, clocks.
    pub fn text(&self, flops: f64) -> String {
        format!(
            "{:8.3} ms  {:6.1} TFLOP/s  (first half {:.3} ms){}",
            self.ms,
            flops / (self.ms * 1e-3) / 1e12,
            self.ms_first_half,
            self.clocks
                .as_ref()
                .map_or(String::new(), ClockSummary::text)
        )
    }
}

/// `reps` back-to-back calls of `call` after `warmup` queued ones, with no host synchronization
/// among them (a training loop's steady state, where the GPU settles under its power cap), and
/// the clocks `sampler` saw over the last half.
///
/// Three events (start, half point, end) rather than one pair per call: the mean between two
/// events counts whatever runs between the calls (launch gaps, a backward's small kernels) as a
/// loop pays it, as benchmarks/peers_fa3_fp8.py times its cudnn-fp8 rows, and hundreds of event
/// pairs would add nothing to a mean. No synchronization at the half point (the peer script has
/// one): the half's start on the host clock, for the sampling window, is the end's host instant
/// less the half's GPU time, so the GPU never idles.
pub fn sustained_run(
    stream: &Arc<CudaStream>,
    warmup: usize,
    reps: usize,
    sampler: Option<&GpuSampler>,
    mut call: impl FnMut(),
) -> Sustained {
    assert!(reps >= 2, "a sustained run needs a call in each half");
    for _ in 0..warmup {
        call();
    }
    let event = || timing_event(stream);
    let half = reps / 2;
    let start = event();
    for _ in 0..half {
        call();
    }
    let mid = event();
    for _ in half..reps {
        call();
    }
    let end = event();
    stream.synchronize().unwrap();
    let end_host = Instant::now();
    let first = start.elapsed_ms(&mid).unwrap() as f64;
    let second = mid.elapsed_ms(&end).unwrap() as f64;
    let mid_host = end_host
        .checked_sub(Duration::from_secs_f64(second * 1e-3))
        .unwrap_or(end_host);
    Sustained {
        reps,
        ms_first_half: first / half as f64,
        ms: second / (reps - half) as f64,
        clocks: sampler.map(|s| s.summary(mid_host, end_host)),
    }
}

/// What `GpuSampler` saw between two instants.
pub struct ClockSummary {
    pub samples: usize,
    /// None when no sample fell in the window.
    pub stats: Option<ClockStats>,
}

pub struct ClockStats {
    pub sm_mhz_median: f64,
    pub sm_mhz_min: f64,
    pub power_w_median: f64,
    pub power_w_max: f64,
    /// None where nvidia-smi reports no temperature.
    pub temp_c_max: Option<f64>,
}

impl ClockSummary {
    /// `, "clock_source": ..., "sm_clock_mhz_median": ...`: the field names of
    /// benchmarks/peers_fa3_fp8.py's `GpuSampler.summary`, so that rows compare one to one.
    pub fn json_fields(&self) -> String {
        let mut s = format!(
            ", \"clock_source\": \"nvidia-smi\", \"clock_samples\": {}",
            self.samples
        );
        if let Some(c) = &self.stats {
            s += &format!(
                ", \"sm_clock_mhz_median\": {:.0}, \"sm_clock_mhz_min\": {:.0}, \"power_w_median\": {:.1}, \"power_w_max\": {:.1}",
                c.sm_mhz_median, c.sm_mhz_min, c.power_w_median, c.power_w_max
            );
            if let Some(t) = c.temp_c_max {
                s += &format!(", \"temp_c_max\": {t:.0}");
            }
        }
        s
    }
    pub fn text(&self) -> String {
        match &self.stats {
            Some(c) => format!(
                "  SM {:.0} MHz (min {:.0})  {:.0} W (max {:.0}){}",
                c.sm_mhz_median,
                c.sm_mhz_min,
                c.power_w_median,
                c.power_w_max,
                c.temp_c_max
                    .map_or(String::new(), |t| format!("  {t:.0} C"))
            ),
            None => "  no clock samples".into(),
        }
    }
}

/// One line of nvidia-smi's output and when it arrived.
struct ClockSample {
    at: Instant,
    sm_mhz: f64,
    power_w: f64,
    temp_c: Option<f64>,
}

/// The SM clock, board power and temperature of one GPU every 100 ms, from `nvidia-smi`
/// running in the background, so that a sustained run can say at what clock and power its time
/// was measured. It never panics: without nvidia-smi, `start` gives None and the rows carry no
/// clock fields. Dropping it ends the child process.
pub struct GpuSampler {
    child: Child,
    reader: Option<JoinHandle<()>>,
    samples: Arc<Mutex<Vec<ClockSample>>>,
}

/// An executable on PATH.
fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

impl GpuSampler {
    /// Starts sampling GPU `ordinal` as nvidia-smi numbers them (PCI order, whatever
    /// CUDA_VISIBLE_DEVICES says: the same GPU as CUDA's device 0 on a one-GPU machine); None
    /// where nvidia-smi is not found or cannot start.
    pub fn start(ordinal: usize) -> Option<GpuSampler> {
        let smi = which("nvidia-smi")?;
        // Each sample is dated by its line's arrival, so the lines must come as they are
        // written: into a pipe, stdio buffers them by blocks (minutes of samples), unless
        // stdbuf makes it flush each line (as the peer script runs it).
        let mut cmd = match which("stdbuf") {
            Some(stdbuf) => {
                let mut c = Command::new(stdbuf);
                c.arg("-oL").arg(&smi);
                c
            }
            None => Command::new(&smi),
        };
        cmd.args([
            "--query-gpu=clocks.sm,power.draw,temperature.gpu",
            "--format=csv,noheader,nounits",
            "-lms",
            "100",
            "-i",
            &ordinal.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        let mut child = cmd.spawn().ok()?;
        let samples = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&samples);
        let reader = child.stdout.take().and_then(|stdout| {
            std::thread::Builder::new()
                .name("nvidia-smi".into())
                .spawn(move || {
                    for line in BufReader::new(stdout).lines() {
                        let Ok(line) = line else { break };
                        if let (Some(s), Ok(mut v)) = (parse_sample(&line), sink.lock()) {
                            v.push(s);
                        }
                    }
                })
                .ok()
        });
        let sampler = GpuSampler {
            child,
            reader,
            samples,
        };
        // Without a reader nothing would be collected; dropping the sampler ends the child.
        sampler.reader.is_some().then_some(sampler)
    }

    /// The median and extremes of the samples that arrived between `from` and `to`.
    pub fn summary(&self, from: Instant, to: Instant) -> ClockSummary {
        let window: Vec<(f64, f64, Option<f64>)> = match self.samples.lock() {
            Ok(v) => v
                .iter()
                .filter(|s| from <= s.at && s.at <= to)
                .map(|s| (s.sm_mhz, s.power_w, s.temp_c))
                .collect(),
            Err(_) => vec![],
        };
        // The upper median, as the peer script takes it.
        let median = |mut xs: Vec<f64>| {
            xs.sort_by(f64::total_cmp);
            xs[xs.len() / 2]
        };
        let stats = (!window.is_empty()).then(|| {
            let clk: Vec<f64> = window.iter().map(|s| s.0).collect();
            let pw: Vec<f64> = window.iter().map(|s| s.1).collect();
            ClockStats {
                sm_mhz_min: clk.iter().copied().fold(f64::INFINITY, f64::min),
                power_w_max: pw.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                sm_mhz_median: median(clk),
                power_w_median: median(pw),
                temp_c_max: window.iter().filter_map(|s| s.2).reduce(f64::max),
            }
        });
        ClockSummary {
            samples: window.len(),
            stats,
        }
    }
}

/// `clock MHz, power W, temperature C`; None for a line without a clock and a power (`[N/A]`).
fn parse_sample(line: &str) -> Option<ClockSample> {
    let at = Instant::now();
    let mut f = line.split(',').map(str::trim);
    let sm_mhz = f.next()?.parse().ok()?;
    let power_w = f.next()?.parse().ok()?;
    let temp_c = f.next().and_then(|t| t.parse().ok());
    Some(ClockSample {
        at,
        sm_mhz,
        power_w,
        temp_c,
    })
}

impl Drop for GpuSampler {
    fn drop(&mut self) {
        // Its own child, by its id; the reader then sees the pipe close.
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}
