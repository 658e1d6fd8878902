//! What the device examples share: their arguments, the device, and the results file of
//! docs/ARCHITECTURE.md (date, device, commit, rows).
#![allow(dead_code)] // each example uses its own part

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
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
    let json = format!(
        "{{\"date\": \"{}\", \"device\": \"{device}\", \"commit\": \"{commit}\"{extra}, \"rows\": [\n{}\n]}}\n",
        today(),
        rows.join(",\n")
    );
    std::fs::write(path, json).expect("write results");
    println!("wrote {path}");
}

/// Milliseconds of `reps` calls of `call`, sorted, each between CUDA events, after `warmup`
/// calls; the calls stay queued (one synchronization at the end), so the host enqueues the timed
/// calls while the GPU is still busy and no launch gap is timed, as the peers are timed.
pub fn queued_times_ms(
    stream: &Arc<CudaStream>,
    warmup: usize,
    reps: usize,
    mut call: impl FnMut(),
) -> Vec<f64> {
    for _ in 0..warmup {
        call();
    }
    let event = || {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap()
    };
    let events: Vec<_> = (0..reps)
        .map(|_| {
            let start = event();
            call();
            (start, event())
        })
        .collect();
    stream.synchronize().unwrap();
    let mut ms: Vec<f64> = events
        .iter()
        .map(|(start, end)| start.elapsed_ms(end).unwrap() as f64)
        .collect();
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    ms
}
