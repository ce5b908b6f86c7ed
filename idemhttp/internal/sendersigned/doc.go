// Package sendersigned checks idemhttp's sender presets against the
// senders' own code: every delivery idemtest signs for a sender with an
// official (or, where the sender has none, its most used) Go library is
// first accepted by that library's verifier, then by the preset, and a
// forged copy is refused by both. It is a module of its own, so the
// senders' SDKs never enter idemhttp's dependencies. docs/senders.md
// names, per sender, the library and version that checks it.
package sendersigned
