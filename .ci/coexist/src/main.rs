//! Both crates in one dependency graph; nothing to run.
fn main() {
    let _ = flashattn::AttentionConfig::new();
    let _ = candle_core::Device::Cpu;
}
