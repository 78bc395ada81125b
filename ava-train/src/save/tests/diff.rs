//! `differing_keys`: the config comparison made on resume.

use serde_json::json;

use crate::save::differing_keys;

#[test]
fn equal_configs_have_no_differences() {
    let config = json!({"model": {"hidden_size": 128, "layers": [1, 2]}, "plugins": {"optimizer": {"name": "adamw"}}});
    assert!(differing_keys(&config, &config.clone(), &["model", "plugins"]).is_empty());
}

#[test]
fn nested_changes_are_dotted_leaf_paths() {
    let saved = json!({"model": {"hidden_size": 128, "attention": {"heads": 4, "kind": "standard"}}});
    let current = json!({"model": {"hidden_size": 256, "attention": {"heads": 4, "kind": "flash"}}});
    assert_eq!(
        differing_keys(&saved, &current, &["model"]),
        ["model.attention.kind: \"standard\" -> \"flash\"", "model.hidden_size: 128 -> 256"]
    );
}

#[test]
fn list_items_are_indexed_and_length_changes_show_absent() {
    let saved = json!({"model": {"dims": [64, 64, 128], "blocks": [{"ff": 4}]}});
    let current = json!({"model": {"dims": [64, 32], "blocks": [{"ff": 4}, {"ff": 8}]}});
    assert_eq!(
        differing_keys(&saved, &current, &["model"]),
        ["model.blocks[1].ff: (absent) -> 8", "model.dims[1]: 64 -> 32", "model.dims[2]: 128 -> (absent)"]
    );
}

#[test]
fn added_and_removed_keys_list_their_leaves() {
    let saved = json!({"plugins": {"memory": {"name": "thresholds", "options": {"warn": 0.8}}, "offload": "ram"}});
    let current = json!({"plugins": {"memory": {"name": "thresholds"}, "checkpoint": {"name": "full", "every": []}}});
    assert_eq!(
        differing_keys(&saved, &current, &["plugins"]),
        [
            "plugins.checkpoint.every: (absent) -> []",
            "plugins.checkpoint.name: (absent) -> \"full\"",
            "plugins.memory.options.warn: 0.8 -> (absent)",
            "plugins.offload: \"ram\" -> (absent)",
        ]
    );
}

#[test]
fn type_changes_and_missing_sections_are_one_line_each() {
    let saved = json!({"model": {"rope": {"theta": 10000}, "tied": true}});
    let current = json!({"model": {"rope": null, "tied": "yes"}, "plugins": {"policy": "vetted"}});
    assert_eq!(
        differing_keys(&saved, &current, &["model", "plugins"]),
        [
            "model.rope: {\"theta\":10000} -> null",
            "model.tied: true -> \"yes\"",
            "plugins.policy: (absent) -> \"vetted\""
        ]
    );
}

#[test]
fn only_the_given_sections_are_compared() {
    let saved = json!({"model": {"hidden_size": 128}, "train": {"lr": 0.001}, "plugins": {"optimizer": {"name": "adamw", "lr": 1}}});
    let current = json!({"model": {"hidden_size": 128}, "train": {"lr": 0.01}, "plugins": {"optimizer": {"name": "lion", "lr": 2}}});
    assert!(differing_keys(&saved, &current, &["model"]).is_empty());
    assert_eq!(differing_keys(&saved, &current, &["train"]), ["train.lr: 0.001 -> 0.01"]);
    // A section may be a dotted path; sections come in the order given.
    assert_eq!(
        differing_keys(&saved, &current, &["train", "plugins.optimizer"]),
        ["train.lr: 0.001 -> 0.01", "plugins.optimizer.lr: 1 -> 2", "plugins.optimizer.name: \"adamw\" -> \"lion\""]
    );
    assert!(differing_keys(&saved, &current, &[]).is_empty());
    assert!(differing_keys(&saved, &current, &["data"]).is_empty());
}
