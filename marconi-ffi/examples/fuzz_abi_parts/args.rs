//! The fuzzers' command lines: flags read in order, each either followed
//! by its value (`--seed 5`) or alone (`--verbose`). `-h` / `--help`
//! prints the fuzzer's usage and exits 0; a flag it does not know, or a
//! value that is missing or does not parse, prints why and the usage to
//! stderr and exits 2.
#![allow(dead_code)]

use std::str::FromStr;

/// What every fuzzer runs: seeds from `seed`, `seeds` of them, `calls`
/// calls a seed, for at most `seconds` (`--seed`, `--seeds`, `--calls`,
/// `--seconds`; each fuzzer says how seeds and seconds combine).
pub(crate) struct Budget {
    pub(crate) seed: u64,
    pub(crate) seeds: u64,
    pub(crate) calls: u64,
    pub(crate) seconds: Option<f64>,
}

impl Budget {
    /// One seed from `seed` of `calls` calls, with no time limit: the
    /// fuzzer's defaults.
    pub(crate) fn new(seed: u64, calls: u64) -> Self {
        Budget {
            seed,
            seeds: 1,
            calls,
            seconds: None,
        }
    }
}

pub(crate) struct CommandLine {
    /// The program, for messages.
    prog: &'static str,
    /// Its usage lines.
    usage: &'static str,
    rest: std::vec::IntoIter<String>,
    /// The flag read last.
    flag: String,
}

impl CommandLine {
    /// The process's arguments, for `prog` with `usage`.
    pub(crate) fn new(prog: &'static str, usage: &'static str) -> Self {
        let args: Vec<String> = std::env::args().skip(1).collect();
        CommandLine {
            prog,
            usage,
            rest: args.into_iter(),
            flag: String::new(),
        }
    }

    /// The next flag; None after the last. `-h` and `--help` print the
    /// usage and exit.
    pub(crate) fn flag(&mut self) -> Option<String> {
        self.flag = self.rest.next()?;
        if self.flag == "-h" || self.flag == "--help" {
            println!("{}", self.usage);
            std::process::exit(0);
        }
        Some(self.flag.clone())
    }

    /// The value of the flag just read, as a `T`.
    pub(crate) fn value<T: FromStr>(&mut self) -> T {
        let v = self.rest.next();
        match v.as_deref().map(str::parse) {
            Some(Ok(x)) => x,
            _ => {
                let got = v.map_or("nothing".into(), |v| format!("{v:?}"));
                let t = std::any::type_name::<T>();
                self.fail(&format!(
                    "{} needs a value of type {t}, got {got}",
                    self.flag
                ))
            }
        }
    }

    /// When `flag` is one of Budget's, its value read into `b`; false
    /// when it is not.
    pub(crate) fn budget(&mut self, flag: &str, b: &mut Budget) -> bool {
        match flag {
            "--seed" => b.seed = self.value(),
            "--seeds" => b.seeds = self.value(),
            "--calls" => b.calls = self.value(),
            "--seconds" => b.seconds = Some(self.value()),
            _ => return false,
        }
        true
    }

    /// The flag just read is none of the fuzzer's.
    pub(crate) fn unknown(&self) -> ! {
        self.fail(&format!("unknown argument {:?}", self.flag))
    }

    fn fail(&self, why: &str) -> ! {
        eprintln!("{}: {why}\n{}", self.prog, self.usage);
        std::process::exit(2)
    }
}
