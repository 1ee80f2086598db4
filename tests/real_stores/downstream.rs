//! The receiver of the ledgers' notifications (`--notify-url`): an HTTP/1.1
//! server on its own threads that answers 200 and keeps what it was sent.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// Every delivery, by `Idempotency-Key`: the bodies, in order.
pub type Received = Arc<Mutex<BTreeMap<String, Vec<Vec<u8>>>>>;

pub struct Downstream {
    pub addr: SocketAddr,
    pub received: Received,
}

impl Downstream {
    pub fn start() -> Downstream {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the downstream");
        let addr = listener.local_addr().unwrap();
        let received = Received::default();
        let keep = received.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let keep = keep.clone();
                std::thread::spawn(move || serve(stream, &keep));
            }
        });
        Downstream { addr, received }
    }

    pub fn url(&self) -> String {
        format!("http://{}/notifications", self.addr)
    }
}

/// Answers each request of one connection with 200 until it closes.
fn serve(stream: TcpStream, received: &Received) {
    let mut writer = stream.try_clone().expect("clone the stream");
    let mut reader = BufReader::new(stream);
    loop {
        let (mut key, mut length) = (String::new(), 0usize);
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let Some((name, value)) = line.trim_end().split_once(':') else {
                break;
            };
            match name.to_ascii_lowercase().as_str() {
                "idempotency-key" => key = value.trim().to_owned(),
                "content-length" => length = value.trim().parse().unwrap_or(0),
                _ => {}
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        received.lock().unwrap().entry(key).or_default().push(body);
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        if writer.write_all(ok).is_err() {
            return;
        }
    }
}
