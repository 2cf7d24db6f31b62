//! The MessagePack layout against msgspec's bytes for vLLM's structs
//! (docs/events.md §3), and decode round trips.

use marconi_events::Namespaces;
use marconi_events::{
    decode_batch, encode_batch, to_decoded, DecodedEvent, HashFormat, Layout, WireEvent,
    WireOptions, GROUP_KV, GROUP_STATE,
};

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// A digest whose last 8 bytes read as `n`.
fn digest(n: u64) -> [u8; 32] {
    let mut d = [0u8; 32];
    d[24..].copy_from_slice(&n.to_be_bytes());
    d
}

fn sample() -> Vec<WireEvent> {
    vec![
        WireEvent::BlockStored {
            block_hashes: vec![digest(1)],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            ns: 0,
            group_idx: GROUP_KV,
            state_position: None,
        },
        WireEvent::BlockRemoved {
            block_hashes: vec![digest(1)],
            group_idx: GROUP_KV,
        },
        WireEvent::AllBlocksCleared,
    ]
}

// msgspec 0.22.0: `msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[...],
// data_parallel_rank=0))` with vLLM's structs (docs/events.md §3).
const MSGSPEC_MAP: &str = "93cb3ff8000000000000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739101b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739101a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400";
const MSGSPEC_ARRAY: &str = "93cb3ff8000000000000939cab426c6f636b53746f7265649101c0940102030404c0a3475055c0c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f7665649101a34750550091b0416c6c426c6f636b73436c656172656400";

#[test]
fn map_layout_is_msgspecs_bytes() {
    let o = WireOptions::default();
    assert_eq!(encode_batch(1.5, &sample(), &o), unhex(MSGSPEC_MAP));
}

#[test]
fn array_layout_is_msgspecs_bytes() {
    let o = WireOptions {
        layout: Layout::Array,
        ..WireOptions::default()
    };
    assert_eq!(encode_batch(1.5, &sample(), &o), unhex(MSGSPEC_ARRAY));
}

fn rich() -> Vec<WireEvent> {
    vec![
        WireEvent::AllBlocksCleared,
        WireEvent::BlockStored {
            block_hashes: vec![digest(u64::MAX), digest(1 << 63), digest(7)],
            parent_block_hash: Some(digest(42)),
            token_ids: vec![0, 70_000, u32::MAX, 5, 6, 7],
            block_size: 2,
            ns: 9,
            group_idx: GROUP_KV,
            state_position: None,
        },
        WireEvent::BlockStored {
            block_hashes: vec![digest(3)],
            parent_block_hash: Some(digest(7)),
            token_ids: vec![8],
            block_size: 2,
            ns: 9,
            group_idx: GROUP_STATE,
            state_position: Some(7),
        },
        WireEvent::BlockRemoved {
            block_hashes: vec![digest(3)],
            group_idx: GROUP_STATE,
        },
    ]
}

#[test]
fn round_trip_in_every_layout_and_hash_form() {
    let namespaces = [
        Namespaces::CacheSalt,
        Namespaces::Lora,
        Namespaces::ExtraKeys,
    ];
    for (layout, hash_format, namespaces) in [Layout::Map, Layout::Array]
        .into_iter()
        .flat_map(|l| [HashFormat::Int, HashFormat::Bytes].map(|h| (l, h)))
        .flat_map(|(l, h)| namespaces.map(|n| (l, h, n)))
    {
        let o = WireOptions {
            layout,
            hash_format,
            medium: "GPU".into(),
            data_parallel_rank: 3,
            namespaces,
        };
        let events = rich();
        let b = decode_batch(&encode_batch(2.25, &events, &o)).unwrap();
        assert_eq!(b.ts, 2.25);
        assert_eq!(b.data_parallel_rank, Some(3));
        assert_eq!(b.unknown, 0);
        let want: Vec<DecodedEvent> = events.iter().map(to_decoded).collect();
        assert_eq!(b.events, want, "{layout:?} {hash_format:?} {namespaces:?}");
    }
}

#[test]
fn unknown_types_are_skipped_and_garbage_is_an_error() {
    // [1.0, [{"type": "Future"}, {"type": "AllBlocksCleared"}], 0]
    let mut p = vec![0x93, 0xcb];
    p.extend_from_slice(&1.0f64.to_be_bytes());
    p.extend_from_slice(&[0x92, 0x81, 0xa4]);
    p.extend_from_slice(b"type");
    p.push(0xa6);
    p.extend_from_slice(b"Future");
    p.extend_from_slice(&[0x81, 0xa4]);
    p.extend_from_slice(b"type");
    p.push(0xb0);
    p.extend_from_slice(b"AllBlocksCleared");
    p.push(0x00);
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.unknown, 1);
    assert_eq!(b.events, vec![DecodedEvent::AllBlocksCleared]);
    assert!(decode_batch(&[]).is_err());
    assert!(decode_batch(&[0xc1]).is_err());
    assert!(decode_batch(&[0x90]).is_err());
    let mut trailing = encode_batch(1.0, &[], &WireOptions::default());
    trailing.push(0);
    assert!(decode_batch(&trailing).is_err());
}
