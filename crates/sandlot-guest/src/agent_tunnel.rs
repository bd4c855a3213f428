//! The agent's tunnel call (`POST /v1/connect`, protocol in
//! [`sandlot_guest::agent_proto::PATH_CONNECT`]): one TCP connection to a port on the
//! sandbox's loopback, carried by one HTTP/2 stream. The agent's network namespace is the
//! workload's (execs unshare only a pid namespace; a VM guest has a single one), so
//! `127.0.0.1` here is the loopback the sandbox's servers listen on.
//!
//! Memory per tunnel is bounded: one read buffer ([`READ_CHUNK`]) service → client, whose
//! next read waits until HTTP/2 flow control lets the chunk go; client → service, one
//! received DATA frame at a time, written before the next is taken (its window is released
//! only then).
use std::convert::Infallible;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame as BodyFrame;
use hyper::{Response, StatusCode};
use sandlot_guest::agent_proto::{ConnectRequest, CONNECT_REFUSED_PREFIX};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// Largest read from the service per response DATA frame, bytes.
const READ_CHUNK: usize = 64 * 1024;

fn text(status: StatusCode, msg: impl Into<String>) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(Full::new(Bytes::from(msg.into())).boxed())
        .expect("valid response")
}

/// `POST /v1/connect`: connects to `127.0.0.1:port` and pumps bytes both ways (see the
/// module docs). `body` is the request body; `connect_timeout` is
/// [`sandlot_guest::agent_proto::CONNECT_TIMEOUT_MS`] in the agent (shorter in tests).
pub async fn connect<B>(mut body: B, connect_timeout: Duration) -> Response<Body>
where
    B: hyper::body::Body<Data = Bytes> + Unpin + Send + 'static,
    B::Error: std::fmt::Display + Send,
{
    let (req, first) = match crate::agent::read_spec::<ConnectRequest, _>(&mut body).await {
        Ok((req, dec)) => (req, dec.into_rest()),
        Err(msg) => return text(StatusCode::BAD_REQUEST, msg),
    };
    let port = req.port;
    if port == 0 {
        return text(StatusCode::BAD_REQUEST, "port 0 cannot be reached");
    }
    let addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port));
    let stream = match tokio::time::timeout(connect_timeout, tokio::net::TcpStream::connect(addr))
        .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            return text(
                StatusCode::BAD_GATEWAY,
                format!("{CONNECT_REFUSED_PREFIX} {port} (connection to 127.0.0.1:{port} refused)"),
            )
        }
        Ok(Err(e)) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("connect to 127.0.0.1:{port}: {e}"),
            )
        }
        Err(_) => {
            return text(
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "{CONNECT_REFUSED_PREFIX} {port} (no accept within {} ms)",
                    connect_timeout.as_millis()
                ),
            )
        }
    };
    let _ = stream.set_nodelay(true);
    let (rd, mut wr) = stream.into_split();
    // Client → service. Ends at the request body's end (half-close) or at a reset (the
    // write half is dropped; the read half goes with the response body).
    tokio::spawn(async move {
        if !first.is_empty() && wr.write_all(&first).await.is_err() {
            return;
        }
        loop {
            match body.frame().await {
                Some(Ok(fr)) => {
                    if let Ok(data) = fr.into_data() {
                        if wr.write_all(&data).await.is_err() {
                            return;
                        }
                    }
                }
                Some(Err(_)) => return,
                None => {
                    let _ = wr.shutdown().await;
                    // Keep the half alive (dropping it would shut down again; harmless).
                    return;
                }
            }
        }
    });
    // Service → client: one read per DATA frame; EOF (or a read error) ends the body.
    let out = futures_util::stream::unfold(rd, |mut rd| async move {
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        match rd.read_buf(&mut buf).await {
            Ok(0) | Err(_) => None,
            Ok(_) => Some((Ok::<_, Infallible>(BodyFrame::data(buf.freeze())), rd)),
        }
    });
    Response::new(StreamBody::new(out).boxed())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandlot_guest::agent_proto::{encode, FrameKind};
    use tokio::sync::mpsc;

    type ReqFrame = Result<BodyFrame<Bytes>, Infallible>;

    /// A request body fed from a channel (the HTTP/2 stream's DATA frames).
    fn req_body() -> (
        mpsc::Sender<ReqFrame>,
        StreamBody<impl futures_util::Stream<Item = ReqFrame> + Unpin>,
    ) {
        let (tx, rx) = mpsc::channel::<ReqFrame>(4);
        let s =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|f| (f, rx)) },
            );
        (tx, StreamBody::new(Box::pin(s)))
    }

    fn spec(port: u16) -> Vec<u8> {
        encode(FrameKind::Spec, format!("{{\"port\":{port}}}").as_bytes())
    }

    async fn body_text(r: Response<Body>) -> String {
        let b = r.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8_lossy(&b).into_owned()
    }

    #[tokio::test]
    async fn bytes_flow_both_ways_and_the_body_end_half_closes() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut got = Vec::new();
            // Reads to EOF: only the client's half-close ends this.
            s.read_to_end(&mut got).await.unwrap();
            s.write_all(b"got:").await.unwrap();
            s.write_all(&got).await.unwrap();
        });
        let (tx, body) = req_body();
        // The spec and the first client bytes in one DATA frame, more in a second.
        let mut first = spec(port);
        first.extend_from_slice(b"hello");
        tx.send(Ok(BodyFrame::data(first.into()))).await.unwrap();
        let resp = connect(body, Duration::from_secs(5)).await;
        assert_eq!(resp.status(), StatusCode::OK);
        tx.send(Ok(BodyFrame::data(Bytes::from_static(b" world"))))
            .await
            .unwrap();
        drop(tx); // end of the request body
        assert_eq!(body_text(resp).await, "got:hello world");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn large_transfers_arrive_whole() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let (mut r, mut w) = s.into_split();
            tokio::io::copy(&mut r, &mut w).await.unwrap();
        });
        let (tx, body) = req_body();
        tx.send(Ok(BodyFrame::data(spec(port).into())))
            .await
            .unwrap();
        let resp = connect(body, Duration::from_secs(5)).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let sent = data.clone();
        tokio::spawn(async move {
            for c in sent.chunks(100_000) {
                tx.send(Ok(BodyFrame::data(Bytes::copy_from_slice(c))))
                    .await
                    .unwrap();
            }
        });
        let got = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(got.len(), data.len());
        assert!(got == data);
    }

    #[tokio::test]
    async fn refused_bad_spec_and_port_zero_are_errors() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let (tx, body) = req_body();
        tx.send(Ok(BodyFrame::data(spec(port).into())))
            .await
            .unwrap();
        let r = connect(body, Duration::from_secs(5)).await;
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        let t = body_text(r).await;
        assert!(
            t.starts_with(&format!("{CONNECT_REFUSED_PREFIX} {port} ")),
            "{t}"
        );

        let (tx, body) = req_body();
        tx.send(Ok(BodyFrame::data(spec(0).into()))).await.unwrap();
        assert_eq!(
            connect(body, Duration::from_secs(5)).await.status(),
            StatusCode::BAD_REQUEST
        );

        let (tx, body) = req_body();
        let bad = encode(FrameKind::Spec, b"{\"port\":1,\"x\":2}");
        tx.send(Ok(BodyFrame::data(bad.into()))).await.unwrap();
        let r = connect(body, Duration::from_secs(5)).await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert!(body_text(r).await.contains("unknown field"));

        let (tx, body) = req_body();
        drop(tx);
        assert_eq!(
            connect(body, Duration::from_secs(5)).await.status(),
            StatusCode::BAD_REQUEST
        );
    }
}
