//! Private PostgreSQL 15 clusters for tests: `initdb` as the `postgres`
//! user into a temporary directory, on a loopback port the test names, and
//! a guard that stops the postmaster (`-m immediate`, then SIGKILL) when the
//! test ends, also on panic. Missing binaries fail the test, never skip it.
//!
//! Included with `#[path = "common/pgcluster.rs"] mod pgcluster;`.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub const BIN: &str = "/usr/lib/postgresql/15/bin";

/// Runs `program` (in [`BIN`]) as the `postgres` user; panics with its
/// output when it fails.
pub fn as_postgres(program: &str, args: &[&str]) -> Output {
    let out = try_as_postgres(program, args);
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn try_as_postgres(program: &str, args: &[&str]) -> Output {
    let path = Path::new(BIN).join(program);
    assert!(
        path.exists(),
        "{} is required (PostgreSQL 15 server binaries: apt-get install postgresql-15)",
        path.display()
    );
    Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run runuser (needs root): {e}"))
}

/// One cluster; stopped when dropped.
pub struct PgCluster {
    dir: tempfile::TempDir,
    pub port: u16,
}

impl PgCluster {
    /// `initdb` (trust authentication) and a configuration listening on
    /// 127.0.0.1:`port` only, with `conf` appended to `postgresql.conf` and
    /// `hba` as the whole of `pg_hba.conf`. Not started.
    pub fn init(port: u16, conf: &str, hba: &str) -> PgCluster {
        let cluster = PgCluster::empty(port);
        as_postgres(
            "initdb",
            &[
                "-D",
                cluster.data().to_str().unwrap(),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        cluster.configure(conf, hba);
        cluster
    }

    /// A temporary directory owned by `postgres`, with no data directory yet.
    pub fn empty(port: u16) -> PgCluster {
        let dir = tempfile::Builder::new()
            .prefix("pgcluster-")
            .tempdir()
            .unwrap();
        chown_postgres(dir.path());
        PgCluster { dir, port }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Appends `conf` (after this cluster's port, address and socket
    /// directory) and replaces `pg_hba.conf` with `hba`.
    pub fn configure(&self, conf: &str, hba: &str) {
        let data = self.data();
        let mut text = std::fs::read_to_string(data.join("postgresql.conf")).unwrap();
        text.push_str(&format!(
            "\nport = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nfsync = off\n{conf}\n",
            self.port,
            self.dir.path().display()
        ));
        std::fs::write(data.join("postgresql.conf"), text).unwrap();
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
    }

    /// Writes `contents` to `name` in the data directory, owned by
    /// `postgres` with mode 0600 (as the server wants its key).
    pub fn write_private(&self, name: &str, contents: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.data().join(name);
        std::fs::write(&path, contents).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        chown_postgres(&path);
        path
    }

    pub fn start(&self) {
        let log = self.dir.path().join("server.log");
        let out = try_as_postgres(
            "pg_ctl",
            &[
                "-D",
                self.data().to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
        assert!(
            out.status.success(),
            "the cluster on port {} did not start: {}\n{}",
            self.port,
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// `pg_ctl stop -m immediate`: the postmaster and its backends end at
    /// once, as in a crash.
    pub fn stop_immediate(&self) {
        as_postgres(
            "pg_ctl",
            &[
                "-D",
                self.data().to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        );
    }

    /// Promotes a standby and waits until it accepts writes.
    pub fn promote(&self) {
        as_postgres(
            "pg_ctl",
            &[
                "-D",
                self.data().to_str().unwrap(),
                "-w",
                "-t",
                "60",
                "promote",
            ],
        );
    }

    /// `psql -c sql` on this cluster as `postgres`; the output, unaligned.
    pub fn psql(&self, sql: &str) -> String {
        let out = as_postgres(
            "psql",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-XAtq",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ],
        );
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }

    /// A streaming standby of this (running) cluster on `port`:
    /// `pg_basebackup -R` (so it follows this primary), not started.
    pub fn standby(&self, port: u16, name: &str) -> PgCluster {
        let standby = PgCluster::empty(port);
        as_postgres(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-D",
                standby.data().to_str().unwrap(),
                "-R",
                "-X",
                "stream",
                "--no-sync",
                "-d",
                &format!("application_name={name}"),
            ],
        );
        // The copied postgresql.conf carries the primary's port and socket
        // directory; later lines win.
        let mut text = std::fs::read_to_string(standby.data().join("postgresql.conf")).unwrap();
        text.push_str(&format!(
            "\nport = {}\nunix_socket_directories = '{}'\n",
            standby.port,
            standby.dir.path().display()
        ));
        std::fs::write(standby.data().join("postgresql.conf"), text).unwrap();
        standby
    }

    fn postmaster_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.data().join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let Some(pid) = self.postmaster_pid() else {
            return;
        };
        let stopped = try_as_postgres(
            "pg_ctl",
            &[
                "-D",
                self.data().to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "-t",
                "10",
                "stop",
            ],
        );
        if !stopped.status.success() && Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

fn chown_postgres(path: &Path) {
    let status = Command::new("chown")
        .arg("postgres:postgres")
        .arg(path)
        .status()
        .expect("chown");
    assert!(status.success(), "chown postgres {}", path.display());
}

/// A CA and the certificates it signs, made fresh by the test.
pub struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pub cert_pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert_pem = params.self_signed(&key).unwrap().pem();
        TestCa {
            issuer: rcgen::Issuer::new(params, key),
            cert_pem,
        }
    }

    /// A server certificate for `names` (DNS names): (certificate PEM, key PEM).
    pub fn server(&self, names: &[&str]) -> (String, String) {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = rcgen::CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "test server");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// Polls `condition` every 50 ms until it holds; panics with `what` past
/// `limit`.
pub fn wait_until(limit: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
