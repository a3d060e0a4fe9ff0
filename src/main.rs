//! vublk entry point: parse, validate, run, and report errors on one line each.

use std::process::ExitCode;

use clap::Parser;

use vublk::args::Args;
use vublk::config::{capabilities_json, Config};

/// Exit status for bad command-line input.
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // One line naming the option, not clap's multi-line usage block.
            let msg = e.render().to_string();
            let first = msg.lines().next().unwrap_or("invalid arguments");
            eprintln!("vublk: {}", first.trim_start_matches("error: "));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if let Some(vublk::args::Command::Create(c)) = &args.command {
        let params =
            match vublk::config::create_request(c).and_then(|r| vublk::image::create::params(&r)) {
                Ok(p) => p,
                Err(msg) => {
                    eprintln!("vublk create: {msg}");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
        return match vublk::image::create::create(&c.file, &params) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                print_error_chain("vublk create", &e);
                ExitCode::FAILURE
            }
        };
    }
    if let Some(vublk::args::Command::GenerateAssets(g)) = &args.command {
        return match vublk::assets::generate(&g.dir, &g.binary) {
            Ok(files) => {
                for f in files {
                    println!("{}", f.display());
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("vublk generate-assets: {}: {e}", g.dir.display());
                ExitCode::FAILURE
            }
        };
    }
    if let Some(vublk::args::Command::Ctl(c)) = &args.command {
        return ctl(c);
    }
    if args.print_capabilities {
        println!("{}", capabilities_json());
        return ExitCode::SUCCESS;
    }
    let cfg = match Config::from_args(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vublk: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let mut logger = env_logger::Builder::new();
    logger.filter_level(cfg.log_level).format_target(false);
    if args.log_format == vublk::args::LogFormat::Json {
        logger.format(vublk::logging::json_format);
    }
    logger.init();
    match vublk::daemon::run(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(vublk::daemon::DaemonError::Usage(msg)) => {
            eprintln!("vublk: {msg}");
            ExitCode::from(EXIT_USAGE)
        }
        Err(e) => {
            print_error_chain("vublk", &e);
            ExitCode::FAILURE
        }
    }
}

/// `vublk ctl --control-socket PATH METHOD ...`: one request, its JSON result printed (exit
/// 0) or its error (exit 1); `top`, the live view.
fn ctl(c: &vublk::args::CtlArgs) -> ExitCode {
    let Some(socket) = &c.control_socket else {
        eprintln!("vublk ctl: --control-socket PATH is needed (the daemon's --control-socket)");
        return ExitCode::from(EXIT_USAGE);
    };
    if let vublk::args::CtlMethod::Top { once, interval } = c.method {
        return match vublk::top::run(socket, once, std::time::Duration::from_secs_f64(interval)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(msg) => {
                eprintln!("vublk ctl top: {msg}");
                ExitCode::FAILURE
            }
        };
    }
    let (method, params) = match vublk::control::request_of(&c.method) {
        Ok(r) => r,
        Err(msg) => {
            eprintln!("vublk ctl: {msg}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match vublk::control::client(socket, &method, params) {
        Ok(v) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string())
            );
            ExitCode::SUCCESS
        }
        Err(msg) => {
            eprintln!("vublk ctl: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// One line: the error and every source, colon-separated.
fn print_error_chain(prefix: &str, e: &dyn std::error::Error) {
    eprintln!("{prefix}: {}", vublk::logging::error_chain(e));
}
