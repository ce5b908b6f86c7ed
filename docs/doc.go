// Package docs holds no code of its own: its tests keep README.md and
// docs/*.md true. TestCodeBlocks fails for a Go code block that no Go file
// of the repository holds line for line, so every block is compiled in CI
// (the blocks of README.md and docs/ live in snippets_test.go, as functions
// that are compiled and never run); receiver_test.go is the receiver test
// docs/http.md shows, run against a real PostgreSQL.
package docs
