// Package outboundsdk checks idemhttp.Transport and the effect ledger
// through the client libraries a team calls other companies' APIs with
// (openai-go, twilio-go, sendgrid-go, aws-sdk-go-v2, go-github; stripe-go
// is checked in idemhttp itself, which depends on it), each against a
// local API that counts what it acted on and, where the real one does,
// deduplicates by key. Each test is a row of the table in docs/effects.md:
// how the library's writes get the effect's key (or what to use where its
// API takes none), whether its context reaches the Transport, and what its
// own retry loop does. It is a module of its own, so these SDKs never
// enter idemhttp's dependencies.
package outboundsdk
