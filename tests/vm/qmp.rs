//! A QMP connection to a QEMU the test started (one command at a time; events are skipped).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use super::ChildGuard;

/// A QMP connection (one command at a time; events are skipped).
pub struct Qmp {
    reader: BufReader<UnixStream>,
    pub writer: UnixStream,
}

impl Qmp {
    pub fn connect(path: &Path, owner: &mut ChildGuard) -> Qmp {
        let deadline = Instant::now() + Duration::from_secs(30);
        let s = loop {
            if let Ok(s) = UnixStream::connect(path) {
                break s;
            }
            if let Ok(Some(st)) = owner.try_wait() {
                panic!("QEMU exited ({st}) before its QMP socket was up");
            }
            assert!(
                Instant::now() < deadline,
                "no QMP socket at {}",
                path.display()
            );
            thread::sleep(Duration::from_millis(20));
        };
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut q = Qmp {
            reader: BufReader::new(s.try_clone().unwrap()),
            writer: s,
        };
        let greeting = q.line();
        assert!(greeting.contains("QMP"), "QMP greeting: {greeting}");
        q.cmd(r#"{"execute":"qmp_capabilities"}"#);
        q
    }

    pub fn line(&mut self) -> String {
        let mut l = String::new();
        self.reader.read_line(&mut l).expect("QMP read");
        assert!(!l.is_empty(), "QMP connection closed");
        l
    }

    /// Send `json`, return the reply ("return" or "error" line).
    pub fn cmd(&mut self, json: &str) -> String {
        self.writer.write_all(json.as_bytes()).unwrap();
        self.writer.write_all(b"\n").unwrap();
        loop {
            let l = self.line();
            if l.contains("\"return\"") || l.contains("\"error\"") {
                return l;
            }
        }
    }

    /// Send `json`; its reply must not be an error.
    pub fn ok(&mut self, json: &str) -> String {
        let r = self.cmd(json);
        assert!(!r.contains("\"error\""), "QMP {json}: {r}");
        r
    }
}

/// A number field of a QMP reply (`"key": N`).
pub fn field(reply: &str, key: &str) -> Option<u64> {
    let i = reply.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = reply[i..].trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}
