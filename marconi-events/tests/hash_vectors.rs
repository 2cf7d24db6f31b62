//! The test vectors of docs/events.md §2 (computed with Python's cbor2 +
//! hashlib, i.e. vLLM's `sha256_cbor`).

use marconi_events::{external, BlockHasher, Namespaces};

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn none_hash_of_the_default_seed_and_of_pythonhashseed_0() {
    assert_eq!(
        hex(BlockHasher::default().none_hash()),
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    );
    assert_eq!(
        hex(BlockHasher::new("0").none_hash()),
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    );
}

#[test]
fn chain_of_three_blocks() {
    let h = BlockHasher::default();
    let tokens: Vec<u32> = (1..=12).collect();
    let chain = h.chain(&tokens, 4, 0);
    let want = [
        (
            "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
            9561501211280363793u64,
        ),
        (
            "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1",
            15292913576410714033,
        ),
        (
            "321cf73a943519e37f9c8afa804132a5b9076e22b40b2d5fe6f7a2886960a68a",
            16642949654738151050,
        ),
    ];
    assert_eq!(chain.len(), 3);
    for (d, (hx, int)) in chain.iter().zip(want) {
        assert_eq!(hex(d), hx);
        assert_eq!(external(d), int);
    }
    // A trailing partial block is not part of the chain.
    assert_eq!(h.chain(&tokens[..11], 4, 0), chain[..2]);
}

#[test]
fn integer_widths_and_namespaces() {
    let h = BlockHasher::default();
    let d = h.hash_block(None, &[0, 23, 24, 255, 256, 65535, 65536, u32::MAX], 0);
    assert_eq!(
        hex(&d),
        "deaa46fcabbf6b126d28ad1292550fb894177c76c7b8e270e04824cbf674d83f"
    );
    assert_eq!(external(&d), 16161207721250838591);
    // Namespace 7 as vLLM hashes `cache_salt = "7"` (the default): the
    // first block's extra keys (("cache_salt", "7"),), the others none.
    let chain = h.chain(&[1, 2, 3, 4, 5, 6, 7, 8], 4, 7);
    assert_eq!(
        hex(&chain[0]),
        "d7316a0e913e38db7ed69444a59e96ee58dafb72d76666030cbd4bcd3ff9cf70"
    );
    assert_eq!(external(&chain[0]), 917973243967164272);
    assert_eq!(
        hex(&chain[1]),
        "38b59c52169b8f6dd4e26bd3605a528c6c355d5dbc10a257a78fa8c6675b777f"
    );
    assert_eq!(external(&chain[1]), 12074054696094627711);
    // As vLLM hashes the LoRA adapter named "7" with an empty path: every
    // block (("lora", "7", ""),).
    let lora = BlockHasher::default().with_namespaces(Namespaces::Lora);
    let chain = lora.chain(&[1, 2, 3, 4, 5, 6, 7, 8], 4, 7);
    assert_eq!(
        hex(&chain[0]),
        "c1a2aaeb66efdc051463483b14f3ac7ef1c4e523810bd134e89988840ac04788"
    );
    assert_eq!(
        hex(&chain[1]),
        "6384f3eb667215ad0e5e6869363d498db1f932551aacc301cfd29f33ec996c30"
    );
    assert_eq!(external(&chain[1]), 14975206756321946672);
    // The earlier form: extra keys [7] on every block.
    let ints = BlockHasher::default().with_namespaces(Namespaces::ExtraKeys);
    let d = ints.hash_block(None, &[1, 2, 3, 4], 7);
    assert_eq!(
        hex(&d),
        "bddf41fde67fbb9268664a0097956ad2f829e3c3d59c4880b62c02ed570b587f"
    );
    assert_eq!(external(&d), 13126870232269019263);
}
