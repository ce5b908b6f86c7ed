package outboundsdk_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// openaiAPI is a stand-in for a chat completions endpoint that honours
// Idempotency-Key (each completion is billed: a charge); its answer is the
// first user message of the completion it made, so an answer given for
// another request shows.
func openaiAPI(lose int) *api {
	return &api{key: headerKey, lose: lose, answer: func(w http.ResponseWriter, id, body string) {
		var req struct {
			Messages []struct {
				Content string `json:"content"`
			} `json:"messages"`
		}
		_ = json.Unmarshal([]byte(body), &req)
		content := ""
		if len(req.Messages) > 0 {
			content = req.Messages[0].Content
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{
			"id": id, "object": "chat.completion", "created": 1, "model": "gpt-4o",
			"choices": []any{map[string]any{"index": 0, "finish_reason": "stop",
				"message": map[string]any{"role": "assistant", "content": content}}},
		})
	}}
}

// openaiClient is openai-go's own client against url through rt, with its
// own retry loop (up to retries retries; it retries a lost answer, a 408,
// 409, 429 and 5xx, each attempt a clone of the request with the caller's
// context).
func openaiClient(url string, rt http.RoundTripper, retries int) openai.Client {
	return openai.NewClient(option.WithAPIKey("sk-test"), option.WithBaseURL(url+"/"),
		option.WithHTTPClient(&http.Client{Transport: rt}), option.WithMaxRetries(retries))
}

func complete(ctx context.Context, oc openai.Client, prompt string, opts ...option.RequestOption) (string, error) {
	cc, err := oc.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model: openai.ChatModelGPT4o, Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
	}, opts...)
	if err != nil {
		return "", err
	}
	return cc.ID + ":" + cc.Choices[0].Message.Content, nil
}

// TestOutboundOpenAIEffectForgotten: openai-go's writes carry no key of
// their own; a team keys them by hand with a fresh key per call
// (option.WithHeader, as stripe-go does by itself) and forgets the Effect
// wrapper. The Transport once let such a write through ("the caller keyed
// it"): 3 deliveries, 3 completions billed. A write outside an effect is
// refused whatever key it carries: nothing is billed, every delivery
// fails with ErrNoEffect (openai-go's retry loop retries the refusal,
// which is refused again).
func TestOutboundOpenAIEffectForgotten(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 4), nil)
	a := openaiAPI(0)
	srv := serve(t, a)
	rt, err := idemhttp.NewTransport(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	oc := openaiClient(srv.URL, rt, 1)
	var errs []error
	for range 3 { // the event's deliveries
		_, err := c.Do(ctx, "support", "ticket-9", func(ctx context.Context) (any, error) {
			if _, err := complete(ctx, oc, "summarize ticket 9", option.WithHeader("Idempotency-Key", rand.Text())); err != nil {
				return nil, err
			}
			return nil, errors.New("the ticket store is down") // the event fails after the call
		})
		errs = append(errs, err)
	}
	if n, keys := a.counts(); n != 0 {
		t.Fatalf("3 deliveries: %d completions billed (keys %q); want none", n, keys)
	}
	for i, err := range errs {
		if !errors.Is(err, idemhttp.ErrNoEffect) {
			t.Fatalf("delivery %d: %v, want ErrNoEffect", i+1, err)
		}
	}
}

// TestOutboundOpenAINestedDo: a ticket's notify effect writes each
// recipient's message inside a DoValue of its own. The inner Do's writes
// once carried the notify effect's key: the API answered the second
// recipient with the first's completion. The effect a request belongs to
// is the innermost one of the innermost event: without an Effect in the
// inner Do the writes are refused (nothing billed); with one, each
// recipient's write carries its own key, and with every first answer lost
// (openai-go retries it, under the same key) and the event delivered
// three times, two completions are billed, each the recipient's own.
func TestOutboundOpenAINestedDo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 6), nil)
	rt, err := idemhttp.NewTransport(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	notify := func(oc openai.Client, ticket string, withEffect bool) func(ctx context.Context) (map[string]string, error) {
		return func(ctx context.Context) (map[string]string, error) {
			out := map[string]string{}
			for _, who := range []string{"alice", "bob"} {
				write := func(ctx context.Context) (string, error) { return complete(ctx, oc, "write to "+who) }
				msg, err := idem.DoValue(ctx, c, "message", ticket+"/"+who, func(ctx context.Context) (string, error) {
					if !withEffect {
						return write(ctx)
					}
					return idem.EffectValue(ctx, c, "write", write)
				})
				if err != nil {
					return nil, err
				}
				out[who] = msg
			}
			return out, nil
		}
	}
	t.Run("inner Do without an effect", func(t *testing.T) {
		a := openaiAPI(0)
		oc := openaiClient(serve(t, a).URL, rt, 0)
		_, err := c.Do(ctx, "support", "ticket-9a", func(ctx context.Context) (any, error) {
			return idem.EffectValue(ctx, c, "notify", notify(oc, "ticket-9a", false))
		})
		if n, keys := a.counts(); n != 0 || len(keys) != 0 || !errors.Is(err, idemhttp.ErrNoEffect) {
			t.Fatalf("%d requests (keys %q), %d billed, error %v; want none, ErrNoEffect", len(keys), keys, n, err)
		}
	})
	t.Run("an effect in each inner Do", func(t *testing.T) {
		a := openaiAPI(2)
		oc := openaiClient(serve(t, a).URL, rt, 2)
		for delivery := 1; delivery <= 3; delivery++ {
			res, err := c.Do(ctx, "support", "ticket-9", func(ctx context.Context) (any, error) {
				return idem.EffectValue(ctx, c, "notify", notify(oc, "ticket-9", true))
			})
			if err != nil {
				t.Fatalf("delivery %d: %v", delivery, err)
			}
			var got map[string]string
			if err := json.Unmarshal(res.Result, &got); err != nil || got["alice"] != "act_1:write to alice" || got["bob"] != "act_2:write to bob" {
				t.Fatalf("delivery %d answered %s", delivery, res.Result)
			}
		}
		key := func(who string) string {
			return idem.Effect{Name: "write", EventSource: "message", EventKey: "ticket-9/" + who}.OutboundKey("POST /chat/completions")
		}
		n, keys := a.counts()
		if want := []string{key("alice"), key("alice"), key("bob"), key("bob")}; n != 2 || fmt.Sprint(keys) != fmt.Sprint(want) {
			t.Fatalf("%d billed, keys %q; want 2, keys %q", n, keys, want)
		}
	})
}
