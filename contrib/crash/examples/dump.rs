//! Prints a recording (`Recording::save`): the initial files, then one line per record.
//!
//! `cargo run -p vublk-crash --example dump -- FILE [FIRST [COUNT]]`

use vublk_crash::{Op, Recording};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        eprintln!("usage: dump FILE [FIRST [COUNT]]");
        std::process::exit(2);
    };
    let rec = Recording::load(path.as_ref()).unwrap_or_else(|e| {
        eprintln!("{path}: {e}");
        std::process::exit(1);
    });
    let first: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(0);
    let count: usize = args
        .get(3)
        .and_then(|a| a.parse().ok())
        .unwrap_or(usize::MAX);
    for (name, id) in &rec.initial.names {
        let len = rec.initial.get(name).map_or(0, |f| f.len());
        println!("initial file {id} {name}: {len} bytes");
    }
    for (i, r) in rec.records.iter().enumerate().skip(first).take(count) {
        let t = r.at_ns as f64 / 1e6;
        match &r.op {
            Op::Write {
                file,
                offset,
                data,
                dsync,
            } => {
                let head: Vec<String> = data.iter().take(16).map(|b| format!("{b:02x}")).collect();
                println!(
                    "{i:6} {t:10.3} ms write file {file} at {offset} len {}{} [{}]",
                    data.len(),
                    if *dsync { " dsync" } else { "" },
                    head.join(" ")
                );
            }
            op => println!("{i:6} {t:10.3} ms {op:?}"),
        }
    }
}
