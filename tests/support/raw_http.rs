//! HTTP/1.1 exchanged byte for byte over a connection of its own: for requests no client
//! library sends (a body shorter than its length, a malformed chunk), and for a head
//! alone, whose body is never sent.

use std::net::SocketAddr;

use reqwest::{
    header::{HeaderMap, HeaderName, HeaderValue},
    StatusCode,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use super::payments::{Reply, DEADLINE};

/// The head of a `POST /v1/payments` as `alice`, declaring a body a byte over `limit`, and
/// no body: the layer refuses it by its declared length before reading a byte. Sending the
/// body would leave it unread when the server closes, which resets the connection, and the
/// reset can reach the client before the answer does.
pub fn oversized_head(key: &str, limit: u64) -> Vec<u8> {
    format!(
        "POST /v1/payments HTTP/1.1\r\nhost: 127.0.0.1\r\nidempotency-key: {key}\r\n\
         authorization: Bearer alice\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        limit + 1
    )
    .into_bytes()
}

/// Sends `request` as it is over a connection of its own (then shuts down the writing half
/// if `half_close`), and reads one HTTP/1.1 response with a `Content-Length`.
pub async fn exchange(addr: SocketAddr, request: &[u8], half_close: bool) -> Reply {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(request).await.expect("send the request");
        if half_close {
            stream.shutdown().await.expect("shut down the writing half");
        }
        let mut received = Vec::new();
        loop {
            if let Some(reply) = parse_response(&received) {
                return reply;
            }
            let mut buffer = [0; 4096];
            let n = stream.read(&mut buffer).await.expect("read the response");
            assert!(
                n > 0,
                "the connection closed before a whole response: {:?}",
                String::from_utf8_lossy(&received)
            );
            received.extend_from_slice(&buffer[..n]);
        }
    };
    tokio::time::timeout(DEADLINE, exchange)
        .await
        .expect("a response in time")
}

/// A whole response in `bytes`, or `None` while it is incomplete.
fn parse_response(bytes: &[u8]) -> Option<Reply> {
    let end = bytes.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&bytes[..end]).expect("an ASCII response head");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("a status line");
    let status = status_line
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("not an HTTP/1.1 status line: {status_line:?}"));
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .unwrap_or_else(|| panic!("not a header line: {line:?}"));
        headers.append(
            HeaderName::from_bytes(name.trim().as_bytes()).expect("a header name"),
            HeaderValue::from_str(value.trim()).expect("a header value"),
        );
    }
    let length: usize = headers
        .get("content-length")
        .expect("a Content-Length")
        .to_str()
        .expect("an ASCII Content-Length")
        .parse()
        .expect("a Content-Length in bytes");
    let body = bytes.get(end + 4..end + 4 + length)?;
    Some(Reply {
        status: StatusCode::from_u16(status).expect("a status"),
        headers,
        body: body.to_vec(),
    })
}
