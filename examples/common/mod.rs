//! What the device examples share: the results file of DESIGN.md §6 (date, device, commit, rows).

use flashattn::DeviceInfo;

/// Today's date as `date +%Y-%m-%d` prints it (empty if `date` cannot run).
pub fn today() -> String {
    let out = std::process::Command::new("date").arg("+%Y-%m-%d").output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Writes `{"date", "device", "commit", <extra>, "rows": [...]}` to `path`; each row is one
/// JSON object already formatted.
pub fn write_results(path: &str, info: &DeviceInfo, commit: &str, extra: &str, rows: &[String]) {
    let json = format!(
        "{{\"date\": \"{}\", \"device\": \"{} (sm_{}{}, {} SMs)\", \"commit\": \"{commit}\"{extra}, \"rows\": [\n{}\n]}}\n",
        today(),
        info.name,
        info.major,
        info.minor,
        info.sm_count,
        rows.join(",\n")
    );
    std::fs::write(path, json).expect("write results");
    println!("wrote {path}");
}
