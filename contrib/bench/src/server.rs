//! Starting and stopping the backend processes: vublk and qemu-storage-daemon serving an
//! image on a vhost-user socket in the work directory (their output goes to NAME.log beside
//! it), the command lines each is given, and the start-up time and idle memory measured on
//! the way. The file itself has no process.

use std::fs::{self, File};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::args::Opts;
use crate::backends::{Backend, BackendKind};
use crate::procstat::rss_kib;

/// A backend process serving the image on a socket (none for the file itself). Dropping it
/// stops the process (SIGTERM, then SIGKILL after 10 s) and removes the socket.
pub struct Server {
    child: Option<Child>,
    pub socket: PathBuf,
    /// From spawning the process to a connect on its socket succeeding.
    pub startup: Duration,
    /// The process's resident memory once it listens.
    pub rss_idle_kib: Option<u64>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            // SAFETY: signalling our own child process.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = fs::remove_file(&self.socket);
    }
}

impl Server {
    /// The backend process, None for the file itself.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }
}

/// Start `backend` serving `image` on WORK/NAME.sock and wait (at most 20 s) until it
/// listens; panics if it cannot be started, exits or does not listen in time.
pub fn start_server(
    backend: &Backend,
    image: &Path,
    opts: &Opts,
    vublk: &Path,
    work: &Path,
) -> Server {
    let socket = work.join(format!("{}.sock", backend.name()));
    let _ = fs::remove_file(&socket);
    let log = File::create(work.join(format!("{}.log", backend.name()))).expect("backend log");
    let mut cmd = match backend.kind {
        BackendKind::File => {
            return Server {
                child: None,
                socket,
                startup: Duration::ZERO,
                rss_idle_kib: None,
            }
        }
        BackendKind::Vublk => {
            let mut c = Command::new(backend.binary.as_deref().unwrap_or(vublk));
            c.arg("--socket-path")
                .arg(&socket)
                .arg("--blk-file")
                .arg(image)
                .arg("--num-queues")
                .arg(opts.backend_queues.to_string())
                .args(&backend.extra);
            c
        }
        BackendKind::Qsd => {
            let mut c = Command::new(&opts.qsd);
            if let Some(k) = qsd_key_file(backend) {
                c.arg("--object").arg(format!("secret,id=sec0,file={k}"));
            }
            c.arg("--blockdev")
                .arg(qsd_blockdev(backend, image))
                .arg("--export")
                .arg(qsd_export("file0", &socket, opts.backend_queues));
            c
        }
    };
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup"))
        .stderr(log);
    spawn(cmd, socket, backend.name())
}

/// Run `cmd` (its output already directed) and wait until it listens on `socket`.
pub fn spawn(mut cmd: Command, socket: PathBuf, name: &str) -> Server {
    let t0 = Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    // Poll for a listening socket (a connect that succeeds), not a fixed sleep.
    let deadline = t0 + Duration::from_secs(20);
    loop {
        if UnixStream::connect(&socket).is_ok() {
            break;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{name} exited during start-up: {st}");
        }
        assert!(Instant::now() < deadline, "{name} did not listen");
        std::thread::sleep(Duration::from_micros(200));
    }
    let startup = t0.elapsed();
    let rss_idle_kib = rss_kib(child.id() as i32);
    Server {
        child: Some(child),
        socket,
        startup,
        rss_idle_kib,
    }
}

/// qemu-storage-daemon's `--blockdev` for `image` (node file0): the driver chain the image's
/// kind and the variant's options call for, O_DIRECT and io_uring unless an option says
/// otherwise.
/// qemu-storage-daemon's `--export` of node `node` as a writable vhost-user-blk device on
/// `socket` with `queues` queues.
pub fn qsd_export(node: &str, socket: &Path, queues: u32) -> String {
    format!(
        "type=vhost-user-blk,id=exp0,node-name={node},addr.type=unix,addr.path={},\
         writable=on,num-queues={queues}",
        socket.display()
    )
}

/// QEMU's null-co driver for vublk's null disk `null:SIZE[?read-zeroes=on|off][&latency-ns=N]`
/// (`spec` without `null:`): the same size, reads of zeroes unless `read-zeroes=off` (as
/// vublk's default; QEMU's own default has changed between versions, so it is always set),
/// the same latency.
pub fn qsd_null(spec: &str, extra: &str) -> String {
    let (size, query) = spec.split_once('?').unwrap_or((spec, ""));
    let size = crate::args::parse_size(size).unwrap_or_else(|e| panic!("null:{spec}: {e}"));
    let mut read_zeroes = "on";
    let mut latency = String::new();
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        match kv.split_once('=') {
            Some(("read-zeroes", v @ ("on" | "off"))) => read_zeroes = v,
            Some(("latency-ns", n)) => latency = format!(",latency-ns={n}"),
            _ => panic!("null:{spec}: {kv:?} (read-zeroes=on|off, latency-ns=N)"),
        }
    }
    format!("driver=null-co,node-name=file0,size={size},read-zeroes={read_zeroes}{latency}{extra}")
}

/// A qsd variant's `key-file=PATH` option: the image is LUKS, opened by QEMU's luks driver
/// with the passphrase in PATH.
fn qsd_key_file(backend: &Backend) -> Option<&str> {
    backend
        .extra
        .iter()
        .flat_map(|e| e.split(','))
        .find_map(|o| o.strip_prefix("key-file="))
}

pub fn qsd_blockdev(backend: &Backend, image: &Path) -> String {
    let extra = backend
        .extra
        .iter()
        .map(|e| format!(",{e}"))
        .collect::<String>();
    // "preallocate" among the options puts QEMU's preallocate filter between the
    // qcow2 node and the file (its defaults: 128 MiB ahead, 1 MiB aligned).
    let prealloc = backend.extra.iter().any(|e| e == "preallocate");
    // "compress": QEMU's compress filter over the qcow2 node (compressed writes);
    // "pagecache": cache.direct=off. Both with aio=threads, QEMU's default, so that
    // /proc/PID/io counts its writes.
    let opt_set: Vec<&str> = backend.extra.iter().flat_map(|e| e.split(',')).collect();
    let compress = opt_set.contains(&"compress");
    let parallels = opt_set.contains(&"parallels");
    let extra = if prealloc || compress || parallels {
        String::new()
    } else {
        extra
    };
    if let Some(spec) = image.to_str().and_then(|s| s.strip_prefix("null:")) {
        return qsd_null(spec, &extra);
    }
    let rbd = image.to_str().and_then(|s| s.strip_prefix("rbd:"));
    let nbd_unix = image
        .to_str()
        .and_then(|s| s.strip_prefix("nbd+unix:///"))
        .and_then(|s| s.split_once("?socket="));
    if qsd_key_file(backend).is_some() {
        // QEMU's luks driver over the file (LUKS1: QEMU reads no other version).
        format!(
            "driver=luks,node-name=file0,key-secret=sec0,file.driver=file,file.filename={},\
             file.cache.direct=on,file.aio=io_uring",
            image.display()
        )
    } else if let Some((export, path)) = nbd_unix {
        // QEMU's NBD client on the same export.
        format!(
            "driver=nbd,node-name=file0,server.type=unix,server.path={path},\
             export={export}{extra}"
        )
    } else if let Some(spec) = rbd {
        // QEMU's rbd driver; cache.direct=on is librbd's cache off (vublk's
        // --cache none). The conf=PATH option comes with the variant's options.
        let (pool, img) = spec.split_once('/').expect("rbd:POOL/IMAGE");
        format!("driver=rbd,node-name=file0,pool={pool},image={img},cache.direct=on{extra}")
    } else if parallels {
        format!(
            "driver=parallels,node-name=file0,file.driver=file,file.filename={},\
             file.cache.direct=on,file.aio=io_uring",
            image.display()
        )
    } else if compress {
        format!(
            "driver=compress,node-name=file0,file.driver=qcow2,file.file.driver=file,\
             file.file.filename={},file.file.cache.direct={},file.file.aio=threads",
            image.display(),
            if opt_set.contains(&"pagecache") {
                "off"
            } else {
                "on"
            }
        )
    } else if image.extension().is_some_and(|e| e == "qcow2") && prealloc {
        format!(
            "driver=qcow2,node-name=file0,file.driver=preallocate,\
             file.file.driver=file,file.file.filename={},file.file.cache.direct=on,\
             file.file.aio=io_uring",
            image.display()
        )
    } else if image.extension().is_some_and(|e| e == "qcow2") {
        format!(
            "driver=qcow2,node-name=file0,file.driver=file,file.filename={},\
             file.cache.direct=on,file.aio=io_uring{extra}",
            image.display()
        )
    } else {
        format!(
            "driver=file,node-name=file0,filename={},cache.direct=on,aio=io_uring{extra}",
            image.display()
        )
    }
}
