//! Recording a skipped test for `contrib/test.sh`'s summary. One file, included both by the
//! integration tests (`tests/common`) and by the library's unit tests (`src/testing.rs`,
//! through `#[path]`), which cannot share a module otherwise.

/// A line `TEST: why` in `$VUBLK_SKIP_LOG` when it names a file (`contrib/test.sh` sets it):
/// a skipped test passes, and captured output would hide why.
pub fn log_skip(why: &str) {
    if let Some(path) = std::env::var_os("VUBLK_SKIP_LOG") {
        use std::io::Write;
        let test = std::thread::current().name().unwrap_or("?").to_owned();
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{test}: {why}");
        }
    }
}
