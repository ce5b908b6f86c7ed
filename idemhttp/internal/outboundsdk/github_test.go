package outboundsdk_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-github/v84/github"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// githubAPI is a stand-in for GitHub's issue comments, which take no
// idempotency key: every POST creates a comment; a GET lists them.
type githubAPI struct{ *api }

func newGitHubAPI(lose int) githubAPI {
	return githubAPI{&api{lose: lose, answer: func(w http.ResponseWriter, id, body string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write(comment(id, body))
	}}}
}

func comment(id, body string) []byte {
	var in struct {
		Body string `json:"body"`
	}
	_ = json.Unmarshal([]byte(body), &in)
	n, _ := strconv.Atoi(strings.TrimPrefix(id, "act_"))
	b, _ := json.Marshal(map[string]any{"id": n, "body": in.Body})
	return b
}

func (g githubAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		g.api.ServeHTTP(w, r)
		return
	}
	g.mu.Lock()
	list := make([]json.RawMessage, len(g.acted))
	for i, body := range g.acted {
		list[i] = comment("act_"+strconv.Itoa(i+1), body)
	}
	g.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(list)
}

// githubClient is go-github's own client against url over rt: every
// method takes the caller's context; it has no retry loop (it sleeps and
// retries once on a rate limit only when the context asks it to).
func githubClient(t *testing.T, base string, rt http.RoundTripper) *github.Client {
	gc := github.NewClient(&http.Client{Transport: rt})
	u, err := url.Parse(base + "/")
	if err != nil {
		t.Fatal(err)
	}
	gc.BaseURL = u
	return gc
}

// TestOutboundGitHub: go-github passes the caller's context on, but
// GitHub's API takes no idempotency key, so a comment whose answer was
// lost is posted again by the effect's next attempt: two comments. The
// alternative where the API can be searched: put the effect's OutboundKey
// in the body, and on Attempt > 1 (an earlier attempt may have acted)
// look for it before acting again: one comment.
func TestOutboundGitHub(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 4), nil)
	rt, err := idemhttp.NewTransport(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	post := func(gc *github.Client, pr string, reconcile bool) (errs []error) {
		for range 3 { // the event's deliveries
			_, err := c.Do(ctx, "ci", pr, func(ctx context.Context) (any, error) {
				return idem.EffectValue(ctx, c, "comment", func(ctx context.Context) (int64, error) {
					eff, _ := idem.EffectFrom(ctx)
					marker := "<!-- idem:" + eff.OutboundKey("comment") + " -->"
					if reconcile && eff.Attempt > 1 {
						found, _, err := gc.Issues.ListComments(ctx, "shop", "app", 7, nil)
						if err != nil {
							return 0, err
						}
						for _, cm := range found {
							if strings.Contains(cm.GetBody(), marker) {
								return cm.GetID(), nil // the earlier attempt's comment
							}
						}
					}
					cm, _, err := gc.Issues.CreateComment(ctx, "shop", "app", 7, &github.IssueComment{Body: github.Ptr("Build passed.\n" + marker)})
					if err != nil {
						return 0, err
					}
					return cm.GetID(), nil
				})
			})
			errs = append(errs, err)
		}
		return errs
	}
	t.Run("no key", func(t *testing.T) {
		a := newGitHubAPI(1)
		errs := post(githubClient(t, serve(t, a).URL, rt), "pr-1", false)
		if n, _ := a.counts(); n != 2 || errs[0] == nil || errs[1] != nil {
			t.Fatalf("%d comments, deliveries %v; want 2: the first's answer lost, the second posted again", n, errs)
		}
	})
	t.Run("OutboundKey in the body", func(t *testing.T) {
		a := newGitHubAPI(1)
		errs := post(githubClient(t, serve(t, a).URL, rt), "pr-2", true)
		if n, _ := a.counts(); n != 1 || errs[0] == nil || errs[1] != nil || errs[2] != nil {
			t.Fatalf("%d comments, deliveries %v; want 1, found again by its key", n, errs)
		}
	})
	t.Run("outside an effect", func(t *testing.T) {
		a := newGitHubAPI(0)
		gc := githubClient(t, serve(t, a).URL, rt)
		_, _, err := gc.Issues.CreateComment(ctx, "shop", "app", 7, &github.IssueComment{Body: github.Ptr("hi")})
		if n, _ := a.counts(); n != 0 || !errors.Is(err, idemhttp.ErrNoEffect) {
			t.Fatalf("%d comments, error %v; want none, ErrNoEffect", n, err)
		}
	})
}
