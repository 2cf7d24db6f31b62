//! `marconi-router serve`'s API (Dynamo's standalone indexer JSON) over a
//! loopback ZeroMQ stream: registration errors as Dynamo answers them, and
//! `/query` scores capped at the deepest resumable state, the KV match in
//! `kv_scores`, a cache salt hashed as vLLM does.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use marconi_router::hash::{ChainHasher, RequestKeys, DEFAULT_SEED};
use marconi_router::serve::{ServeConfig, Service};
use serde_json::{json, Value};

fn port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn key(b: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(b, s).expect("vec");
}

/// `[1.0, [BlockStored(kv) group 0, BlockStored([state]) group 1], 0]`.
fn payload(kv: &[u64], state: u64) -> Vec<u8> {
    let mut b = Vec::new();
    rmp::encode::write_array_len(&mut b, 3).expect("vec");
    rmp::encode::write_f64(&mut b, 1.0).expect("vec");
    rmp::encode::write_array_len(&mut b, 2).expect("vec");
    for (hashes, group) in [(kv, 0u64), (&[state][..], 1)] {
        rmp::encode::write_map_len(&mut b, 5).expect("vec");
        key(&mut b, "type");
        key(&mut b, "BlockStored");
        key(&mut b, "block_hashes");
        rmp::encode::write_array_len(&mut b, hashes.len() as u32).expect("vec");
        for &h in hashes {
            rmp::encode::write_uint(&mut b, h).expect("vec");
        }
        key(&mut b, "block_size");
        rmp::encode::write_uint(&mut b, 4).expect("vec");
        key(&mut b, "group_idx");
        rmp::encode::write_uint(&mut b, group).expect("vec");
        key(&mut b, "kv_cache_spec_kind");
        key(
            &mut b,
            if group == 1 {
                "mamba"
            } else {
                "full_attention"
            },
        );
    }
    rmp::encode::write_uint(&mut b, 0).expect("vec");
    b
}

fn call(s: &mut Service, method: &str, path: &str, body: Value) -> (u16, Value) {
    let r = s.handle(method, path, body.to_string().as_bytes());
    let v = if r.body.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&r.body).unwrap_or(Value::String(r.body))
    };
    (r.status, v)
}

#[test]
fn registration_errors_are_dynamos() {
    let mut s = Service::new(ServeConfig::default());
    let ep = format!("tcp://127.0.0.1:{}", port());
    let reg = json!({"instance_id": 1, "endpoint": ep, "model_name": "m", "block_size": 4});
    assert_eq!(
        call(&mut s, "POST", "/register", reg.clone()),
        (201, json!({"status": "ok"}))
    );
    let (st, body) = call(&mut s, "POST", "/register", reg);
    assert_eq!(st, 409);
    assert_eq!(body["error"], "instance 1 dp_rank 0 already registered");
    let other = json!({"instance_id": 2, "endpoint": ep, "model_name": "m", "block_size": 8});
    assert_eq!(call(&mut s, "POST", "/register", other).0, 409);
    assert_eq!(
        call(&mut s, "POST", "/register", json!({"instance_id": 2})).0,
        422
    );
    let zero = json!({"instance_id": 3, "endpoint": ep, "model_name": "z", "block_size": 0});
    assert_eq!(call(&mut s, "POST", "/register", zero).0, 400);
    let q = json!({"token_ids": [1, 2, 3], "model_name": "nope"});
    assert_eq!(call(&mut s, "POST", "/query", q).0, 404);
    assert_eq!(
        call(&mut s, "POST", "/query", json!({"model_name": "m"})).0,
        422
    );
    let salted = json!({"block_hashes": [1], "model_name": "m", "cache_salt": "x"});
    assert_eq!(call(&mut s, "POST", "/query_by_hash", salted).0, 400);
    let (st, body) = call(
        &mut s,
        "POST",
        "/query",
        json!({"token_ids": [1, 2, 3, 4, 5], "model_name": "m"}),
    );
    assert_eq!(
        (st, body),
        (
            200,
            json!({"scores": {}, "frequencies": [], "instances": {"1": {"longest_matched": 0, "gpu": 0, "dp": {"0": 0}, "cpu": 0, "disk": 0}}, "kv_scores": {}})
        )
    );
    assert_eq!(call(&mut s, "GET", "/health", Value::Null).0, 200);
    assert_eq!(call(&mut s, "GET", "/nothing", Value::Null).0, 404);
    let unreg = json!({"instance_id": 1, "model_name": "m"});
    assert_eq!(call(&mut s, "POST", "/unregister", unreg.clone()).0, 200);
    assert_eq!(call(&mut s, "POST", "/unregister", unreg).0, 404);
    assert_eq!(
        call(&mut s, "GET", "/workers", Value::Null),
        (200, json!([]))
    );
}

#[test]
fn scores_are_capped_at_the_deepest_state() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).expect("PUB");
    let ep = format!("tcp://127.0.0.1:{}", port());
    publisher.bind(&ep).expect("bind");
    let mut s = Service::new(ServeConfig::default());
    let reg = json!({"instance_id": 7, "endpoint": ep, "model_name": "m", "block_size": 4});
    assert_eq!(call(&mut s, "POST", "/register", reg).0, 201);
    // The same stream from a worker without recurrent layers: its KV match
    // is all resumable, so it is scored by it, not capped.
    let reg = json!({"instance_id": 9, "endpoint": ep, "model_name": "m", "block_size": 4,
                     "attention_only": true});
    assert_eq!(call(&mut s, "POST", "/register", reg).0, 201);

    // Three blocks of tokens 1..12 in namespace "salt" (vLLM's cache_salt:
    // the first block's extra keys), a state after block 2 (8 tokens).
    let hasher = ChainHasher::new(DEFAULT_SEED, 4);
    let keys = RequestKeys {
        lora: None,
        cache_salt: Some("salt".into()),
    };
    let tokens: Vec<u32> = (1..=12).collect();
    let mut kv = Vec::new();
    hasher.wire_hashes_keyed(&tokens, &keys, &mut kv);
    let batch = payload(&kv, kv[1]);
    // The SUB connects in the background: publish until the index holds it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seq = 0u64;
    let query = json!({"token_ids": (1..=13).collect::<Vec<u32>>(), "model_name": "m", "cache_salt": "salt"});
    loop {
        assert!(
            Instant::now() < deadline,
            "the stream never reached the index"
        );
        publisher
            .send_multipart([&b""[..], &seq.to_be_bytes(), &batch], 0)
            .expect("send");
        seq += 1;
        s.poll(Duration::from_millis(50)).expect("poll");
        let kv = &call(&mut s, "POST", "/query", query.clone()).1["kv_scores"];
        if kv.get("7").is_some() && kv.get("9").is_some() {
            break;
        }
    }
    let (st, body) = call(&mut s, "POST", "/query", query);
    assert_eq!(st, 200);
    assert_eq!(body["scores"], json!({"7": {"0": 8}, "9": {"0": 12}}));
    assert_eq!(body["kv_scores"], json!({"7": {"0": 12}, "9": {"0": 12}}));
    assert_eq!(body["instances"]["7"]["gpu"], 8);
    assert_eq!(body["instances"]["9"]["gpu"], 12);
    // Without the salt the same tokens hash elsewhere: no match.
    let plain = json!({"token_ids": (1..=13).collect::<Vec<u32>>(), "model_name": "m"});
    assert_eq!(
        call(&mut s, "POST", "/query", plain).1["kv_scores"],
        json!({})
    );
    // By hash: the request is one token past its blocks.
    let by_hash = json!({"block_hashes": kv, "model_name": "m"});
    assert_eq!(
        call(&mut s, "POST", "/query_by_hash", by_hash).1["scores"],
        json!({"7": {"0": 8}, "9": {"0": 12}})
    );
    let (_, dump) = call(&mut s, "GET", "/dump", Value::Null);
    let blocks = dump["m:default"]["events"][0]["event"]["data"]["stored"]["blocks"]
        .as_array()
        .expect("blocks")
        .len();
    assert_eq!(blocks, 3);
    assert_eq!(dump["m:default"]["events"][0]["states"], json!([kv[1]]));
}
