package idemhttp

import (
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"net/http"
	"time"
)

// GitLabRetention is how long the GitLab preset keeps keys. GitLab
// re-sends a delivery when it is resent from the webhook's "Recent events"
// (by hand or through the API), under the same Idempotency-Key
// (docs.gitlab.com/user/project/integrations/webhooks, "Delivery headers");
// GitLab keeps those logs for 7 days, so a week covers every re-send.
const GitLabRetention = 7 * 24 * time.Hour

var gitlabBound = []string{"X-Gitlab-Event", "X-Gitlab-Instance", "X-Gitlab-Webhook-UUID"}

// GitLabVerifier checks X-Gitlab-Token against the webhook's secret
// tokens (constant-time). GitLab sends the token itself, not a signature:
// it proves the sender knows the token and covers nothing of the
// delivery, so anyone holding one delivery can send any body with it.
func GitLabVerifier(tokens ...string) (Verifier, error) {
	if err := checkSecrets("GitLab", tokens); err != nil {
		return nil, err
	}
	digests := make([][32]byte, len(tokens))
	for i, t := range tokens {
		digests[i] = sha256.Sum256([]byte(t))
	}
	return func(r *http.Request, _ []byte) error {
		v, err := oneHeader(r, "GitLab", "X-Gitlab-Token")
		if err != nil {
			return err
		}
		d := sha256.Sum256([]byte(v))
		for _, want := range digests {
			if subtle.ConstantTimeCompare(d[:], want[:]) == 1 {
				return nil
			}
		}
		return fmt.Errorf("%w: GitLab: X-Gitlab-Token does not match", ErrSignatureInvalid)
	}, nil
}

// GitLab keys by Idempotency-Key (GitLab 17.4 and later: the same on every
// re-send of a delivery), falling back to X-Gitlab-Event-UUID, with
// X-Gitlab-Event as the type, and checks X-Gitlab-Token first. Nothing is
// signed: the fingerprint binds the event, instance and webhook headers
// to the body, and the body is deduplicated too (the replay guard), so a
// captured delivery re-sent under a fresh id runs nothing. A token that
// leaked lets its holder send new bodies: rotate it.
func GitLab(tokens ...string) Preset {
	return preset(senderPreset{source: "gitlab", name: "GitLab",
		key: HeaderKey("X-Gitlab-Event", "Idempotency-Key", "X-Gitlab-Event-UUID"), fingerprint: headersFingerprint(gitlabBound...),
		ttl: GitLabRetention, secrets: tokens, verifier: GitLabVerifier,
		// Not X-Gitlab-Token: it is the secret itself, and asynchronous
		// mode stores the headers listed here.
		headers:   append([]string{"Idempotency-Key", "X-Gitlab-Event-UUID"}, gitlabBound...),
		guardBody: true})
}
